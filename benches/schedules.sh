#!/usr/bin/env bash
# Recurring schedules at scale (DESIGN §14): N schedules firing every minute, on this machine:
#   benches/schedules.sh              N (100,000) schedules `"cron": "* * * * *"` (every minute at :00,
#   N=10000 benches/schedules.sh      all due at one instant: the worst case), 1 KiB bodies (BODY_BYTES),
#   RESTART=1 benches/schedules.sh    into the broker sink; KIND=every: `"every": "1m"` instead, each
#   KIND=every benches/schedules.sh   phased from its creation (spread over the seconds the PUTs took)
# Builds the release binary (BIN= another, BUILD= its name in the results) and starts it on a scratch
# data dir under /var/tmp (fsync always, the default); measures the idle server; puts the schedules
# with concurrent PUTs (curl --parallel, CONCURRENCY 64; a PUT is answered once durable and in the
# schedule table), timed; RESTART=1 then restarts the node, which plans every schedule at once, as after
# any restart (without it, the node plans what the PUTs woke, as it goes). B1 is the first minute
# boundary after that. The window runs from 30 s after B1 (SETTLE_MINUTES more minutes later) for
# MINUTES (3) minutes: each minute one burst of firings delivered and the next minute's written
# (planner.rs writes them 30-60 s ahead). A consumer long-polls the topic's queues (1,024 a pull) and
# notes when each answer was read; at the end every firing is read back from the broker and joined to
# its receipt by queue and offset. Printed, as one JSON line and as markdown rows:
#   - lateness at the consumer: its receipt minus the firing's nominal time (header delayd-fire-at), over
#     the firings due in the window (and over those the planner wrote in time, before their nominal
#     time); at the sink call: delivered_at (ms, stamped as the batch goes to the sink) minus the same;
#     the server's own histogram over the window (delayd_delivery_lateness_seconds, sink broker, counted
#     from each message's due time), as the bucket bound a quantile falls under (0.1, 0.25, 0.5, 1, 2.5,
#     5, 10, 25, 50, 100, 250, 500 ms, 1 s, ...); and the same for the firing at B1;
#   - firings: per minute of the window (N each), each schedule once a minute, those written after
#     their nominal time (due at once, so late) and those skipped (delayd_schedule_firings_total
#     {outcome="skipped"}); early (delivered or due before the nominal time) and twice the same
#     (schedule, fire time), anywhere in the run;
#   - memory: VmRSS of the server idle, after the PUTs, after the restart and at the end; per schedule,
#     (RSS - idle RSS) / N at each;
#   - the server's CPU seconds (utime + stime) and disk bytes written (/proc/PID/io write_bytes; of
#     which WAL and broker bytes from its metrics) per minute of the window, and for the PUTs.
# The disk's own speed (dd with oflag=dsync) is printed first. The server is stopped and the scratch
# dir removed at the end (KEEP_WORK=1 keeps it). About 7 minutes at the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-100000}
MINUTES=${MINUTES:-3}
SETTLE_MINUTES=${SETTLE_MINUTES:-0}
RESTART=${RESTART:-0}
KIND=${KIND:-cron}
BODY_BYTES=${BODY_BYTES:-1024}
CONCURRENCY=${CONCURRENCY:-64}
BIN=${BIN:-target/release/delayd}
# What the results say they measured: the commit (for another BIN, say which).
BUILD=${BUILD:-$(git describe --always --dirty 2>/dev/null || echo unknown)}
PORT=${PORT:-7396}
TOPIC=schedules-bench
URL=http://127.0.0.1:$PORT
case $KIND in
  cron) TIMING='"cron": "* * * * *"' ;;
  every) TIMING='"every": "1m"' ;;
  *) echo "KIND is cron or every" >&2; exit 2 ;;
esac
command -v curl >/dev/null || { echo "curl is needed" >&2; exit 1; }

WORK=$(mktemp -d /var/tmp/delayd-schedules.XXXXXX)
DELAYD_PID= CONSUMER_PID=
cleanup() {
  [ -n "$CONSUMER_PID" ] && { kill "$CONSUMER_PID" 2>/dev/null || true; wait "$CONSUMER_PID" 2>/dev/null || true; }
  if [ -n "$DELAYD_PID" ]; then
    kill -TERM "$DELAYD_PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$DELAYD_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$DELAYD_PID" 2>/dev/null || true
    wait "$DELAYD_PID" 2>/dev/null || true
  fi
  if [ -n "${KEEP_WORK:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

# The disk itself, in the scratch dir (benches/disk.sh).
. benches/disk.sh
echo "$DISK_LINE" >&2

if [ "$BIN" = target/release/delayd ]; then
  cargo build --release --bin delayd -q 2>/dev/null || cargo build --release --bin delayd
fi

now() { date +%s.%N; }
sleep_until() { # sleep_until EPOCH_SECONDS
  local left
  left=$(awk -v t="$1" -v n="$(now)" 'BEGIN { d = t - n; printf "%.3f", (d > 0 ? d : 0) }')
  sleep "$left"
}
# sample NAME: the server's memory, CPU ticks, bytes written and metrics now, into $WORK/NAME.*
sample() {
  now >"$WORK/$1.time"
  cat "/proc/$DELAYD_PID/status" >"$WORK/$1.status"
  cat "/proc/$DELAYD_PID/stat" >"$WORK/$1.stat"
  cat "/proc/$DELAYD_PID/io" >"$WORK/$1.io"
  curl -sf "$URL/metrics" >"$WORK/$1.metrics"
}

# start NAME: a delayd on the data dir, its output in $WORK/NAME.out and .log, ready.
start() {
  DELAYD_MIN_FREE_DISK_BYTES=0 "$BIN" serve --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" \
    >"$WORK/$1.out" 2>"$WORK/$1.log" &
  DELAYD_PID=$!
  for _ in $(seq 1200); do grep -qs "delayd ready" "$WORK/$1.out" && return; sleep 0.1; done
  echo "delayd did not start: $(tail -3 "$WORK/$1.log")" >&2
  exit 1
}
start delayd
sleep 5
sample idle

# One body for every schedule: its id is in the URL.
python3 - "$BODY_BYTES" "$TOPIC" "$TIMING" >"$WORK/put.json" <<'PY'
import json, sys
size, topic, timing = int(sys.argv[1]), sys.argv[2], sys.argv[3]
spec = json.loads("{" + timing + "}")
spec.update({"topic": topic, "sink": "broker", "body": "x" * size})
print(json.dumps(spec))
PY
echo "putting $N schedules ($KIND), concurrency $CONCURRENCY" >&2
sample put-start
curl -sS --no-progress-meter -Z --parallel-max "$CONCURRENCY" -X PUT \
  -H 'content-type: application/json' --data-binary "@$WORK/put.json" \
  -o /dev/null -w '%{http_code} %{time_total}\n' "$URL/v1/schedules/s[1-$N]" >"$WORK/puts.txt" || true
sample put-end
sleep 2
sample puts
FROM=$(cat "$WORK/put-end.time")
if [ "$RESTART" = 1 ]; then
  # A node that starts with the schedules plans them all at once (Planner::run), as it would after any
  # restart: the steady state at once, without the PUTs' backlog of wake-ups.
  kill -TERM "$DELAYD_PID"
  wait "$DELAYD_PID" || true
  RESTART_AT=$(now)
  start restarted
  FROM=$(now)
  awk -v a="$RESTART_AT" -v b="$FROM" 'BEGIN { printf "%.2f\n", b - a }' >"$WORK/restart.seconds"
  echo "restarted in $(cat "$WORK/restart.seconds") s" >&2
  sleep 5
  sample restarted
fi
# B1: the first minute boundary after that; the steady window starts 30 s after it (SETTLE_MINUTES
# later).
B1=$(awk -v t="$FROM" 'BEGIN { printf "%d", (int(t / 60) + 1) * 60 }')
W0=$((B1 + 60 * SETTLE_MINUTES + 30))
W1=$((W0 + 60 * MINUTES))
echo "first firing at $(date -u -d "@$B1" +%H:%M:%S), steady window to $(date -u -d "@$W1" +%H:%M:%S) UTC" >&2
# A consumer of the topic, live: one thread per queue long-polls it, 1,024 messages a pull, and notes
# when each pull's answer was read (its messages' receipt). It reads nothing else: the messages are read
# again after the run, and joined to their receipt by queue and offset.
python3 - "$URL" "$TOPIC" "$((W1 + 2))" >"$WORK/receipts.txt" <<'PY' &
import http.client, json, re, sys, threading, time, urllib.parse
url, topic, until = sys.argv[1], sys.argv[2], float(sys.argv[3])
host = urllib.parse.urlparse(url)
def connect():
    return http.client.HTTPConnection(host.hostname, host.port, timeout=60)
def get(conn, path):
    conn.request("GET", path)
    answer = conn.getresponse()
    return answer.status, answer.read()
conn = connect()
while True:  # the topic exists once its first message was delivered
    if time.time() > until:
        sys.exit(0)
    status, body = get(conn, f"/v1/topics/{topic}")
    if status == 200:
        break
    time.sleep(0.01)
receipts = []  # (queue, first offset, next offset, receipt in unix ms)
def consume(queue):
    conn, offset = connect(), 0
    while time.time() < until:
        status, body = get(conn, f"/v1/topics/{topic}/queues/{queue}/messages?offset={offset}&max=1024&wait_ms=500")
        at_ms = time.time() * 1000
        if status != 200:
            raise SystemExit(f"pull: {status} {body[:200]!r}")
        following = int(re.search(rb'"next_offset":(\d+)', body[-100:]).group(1))
        if following > offset:
            receipts.append((queue, offset, following, round(at_ms, 1)))
        offset = following
threads = [threading.Thread(target=consume, args=(q,)) for q in range(len(json.loads(body)["queues"]))]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
for receipt in receipts:
    print(*receipt)
PY
CONSUMER_PID=$!
sleep_until "$W0"
sample w0
sleep_until "$W1"
sample w1
wait "$CONSUMER_PID" || echo "the consumer failed" >&2
CONSUMER_PID=

echo "reading the firings back" >&2
python3 - "$WORK" "$URL" "$TOPIC" "$N" "$MINUTES" "$KIND" "$B1" "$W0" "$W1" "$BODY_BYTES" "$CONCURRENCY" \
  "$DISK_LINE" "$(getconf CLK_TCK)" "$BUILD" <<'PY'
import http.client, json, os, re, sys, urllib.parse
from datetime import datetime

(work, url, topic, n, minutes, kind, b1, w0, w1, body_bytes, concurrency, disk_line,
 ticks, build) = sys.argv[1:]
n, minutes, b1, w0, w1, ticks = int(n), int(minutes), int(b1), int(w0), int(w1), int(ticks)
B1_MS, W0_MS, W1_MS = b1 * 1000, w0 * 1000, w1 * 1000


def read(name, ext):
    with open(f"{work}/{name}.{ext}") as f:
        return f.read()


def status_kb(name, field):
    m = re.search(rf"^{field}:\s+(\d+) kB", read(name, "status"), re.M)
    return int(m.group(1)) if m else 0


def cpu_s(name):
    # /proc/PID/stat: fields after the command's closing parenthesis; utime and stime are 14 and 15.
    fields = read(name, "stat").rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / ticks


def written(name):
    return int(re.search(r"^write_bytes: (\d+)", read(name, "io"), re.M).group(1))


def metric(name, series):
    for line in read(name, "metrics").splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


def buckets(name):
    out = {}
    for line in read(name, "metrics").splitlines():
        m = re.match(r'delayd_delivery_lateness_seconds_bucket\{sink="broker",le="([^"]+)"\} (\S+)', line)
        if m:
            out[float(m.group(1))] = float(m.group(2))
    return out


def ms(text):
    return int(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)


def pct(sorted_values, p):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(p / 100 * len(sorted_values)))]


# Every message of the topic, from each queue's start to its end now.
host = urllib.parse.urlparse(url)
conn = http.client.HTTPConnection(host.hostname, host.port, timeout=60)


def get(path):
    conn.request("GET", path)
    answer = conn.getresponse()
    body = answer.read()
    if answer.status != 200:
        raise SystemExit(f"GET {path}: {answer.status} {body[:200]!r}")
    return json.loads(body)


receipt = {}
for line in read("receipts", "txt").splitlines():
    queue, first, following, at_ms = line.split()
    for offset in range(int(first), int(following)):
        receipt[(int(queue), offset)] = float(at_ms)

firings = []  # (fire_at_ms, schedule, deliver_at_ms, delivered_at_ms, receipt_ms or None)
for q in get(f"/v1/topics/{topic}")["queues"]:
    offset, end = q["min_offset"], q["max_offset"]
    while offset < end:
        page = get(f"/v1/topics/{topic}/queues/{q['queue']}/messages?offset={offset}&max=1024")
        for m in page["messages"]:
            h = m["headers"]
            firings.append((ms(h["delayd-fire-at"]), h["delayd-schedule"], ms(m["deliver_at"]),
                            ms(m["delivered_at"]), receipt.get((q["queue"], m["offset"]))))
        offset = page["next_offset"]

early = sum(1 for f, _, due, at, got in firings if at < f or due < f or (got or f) < f)
due_not_fire = sum(1 for f, _, due, _, _ in firings if due != f)
pairs = len(set((f, s) for f, s, _, _, _ in firings))
unreceived = sum(1 for *_, got in firings if got is None)


def stats(values):
    values = sorted(values)
    if not values:
        return None
    q = lambda p: round(values[min(len(values) - 1, int(p / 100 * len(values)))], 1)
    return {"firings": len(values), "p50": q(50), "p99": q(99), "p999": q(99.9), "max": q(100)}


first = [x for x in firings if x[0] == B1_MS]
# The steady window's firings: due in (W0 - 30 s, W1 - 30 s], MINUTES of them per schedule.
steady = [x for x in firings if W0_MS - 30_000 < x[0] <= W1_MS - 30_000]
per_minute = {}
per_schedule = {}
minute_late = {}  # slot -> lateness at the consumer
for f, s, _, _, got in steady:
    slot = (f - (W0_MS - 30_000) - 1) // 60_000
    per_minute[slot] = per_minute.get(slot, 0) + 1
    per_schedule[s] = per_schedule.get(s, 0) + 1
    if got is not None:
        minute_late.setdefault(slot, []).append(got - f)
every_minute_n = len(per_minute) == minutes and all(c == n for c in per_minute.values())
each_once_a_minute = len(per_schedule) == n and all(c == minutes for c in per_schedule.values())
# Written late: the planner wrote the firing after its nominal time (it is then due at once).
written_late = sum(1 for f, _, due, _, _ in steady if due != f)
lateness = {
    # At the consumer: its receipt (the pull's answer read) minus the nominal time.
    "received": stats(got - f for f, *_, got in steady if got is not None),
    "received_written_in_time": stats(got - f for f, _, due, _, got in steady
                                      if got is not None and due == f),
    # At the server: the lane's read of the batch for the sink (delivered_at) minus the nominal time.
    "handed_to_sink": stats(at - f for f, _, _, at, _ in steady),
    "first_minute_received": stats(got - f for f, *_, got in first if got is not None),
    "first_minute_handed_to_sink": stats(at - f for f, _, _, at, _ in first),
}

# The server's own histogram over the window.
h0, h1 = buckets("w0"), buckets("w1")
hist = {le: h1.get(le, 0) - h0.get(le, 0) for le in h1}
count = hist.get(float("inf"), 0)


def hist_q(q):
    for le in sorted(hist):
        if count and hist[le] >= q * count:
            return "+Inf" if le == float("inf") else f"{le * 1000:g}"
    return None


puts = [line.split() for line in read("puts", "txt").splitlines() if line.strip()]
codes = {}
for code, _ in puts:
    codes[code] = codes.get(code, 0) + 1
put_ms = sorted(float(t) * 1000 for _, t in puts)
put_s = float(read("put-end", "time")) - float(read("put-start", "time"))
window_min = (float(read("w1", "time")) - float(read("w0", "time"))) / 60
fired = "delayd_schedule_firings_total{outcome=\"fired\"}"
skipped = "delayd_schedule_firings_total{outcome=\"skipped\"}"
idle_rss, end_rss = status_kb("idle", "VmRSS"), status_kb("w1", "VmRSS")
restarted = os.path.exists(f"{work}/restarted.status")
result = {
    "build": build, "kind": kind, "schedules": n, "minutes": minutes, "body_bytes": int(body_bytes),
    "restart_to_ready_s": float(read("restart", "seconds")) if restarted else None,
    "put": {
        "seconds": round(put_s, 1), "schedules_per_s": round(n / put_s),
        "codes": codes, "concurrency": int(concurrency),
        "latency_ms_p50": round(pct(put_ms, 50), 1), "latency_ms_p99": round(pct(put_ms, 99), 1),
        "cpu_s": round(cpu_s("put-end") - cpu_s("put-start"), 1),
        "disk_mb": round((written("put-end") - written("put-start")) / 1e6, 1),
    },
    "lateness_ms": lateness,
    "histogram_steady": {"count": int(count), "p50_le_ms": hist_q(0.5), "p99_le_ms": hist_q(0.99),
                         "max_le_ms": hist_q(1.0)},
    "first_minute_firings": len(first), "unreceived": unreceived, "written_late": written_late,
    "early": early, "due_not_at_fire_time": due_not_fire,
    "duplicates": len(firings) - pairs, "firings_read": len(firings),
    "per_minute": [per_minute.get(k, 0) for k in range(minutes)],
    # Each minute of the window: firings, and their lateness at the consumer (p99, max).
    "per_minute_received_p99_max": [
        [(stats(minute_late.get(k, [])) or {}).get(q) for q in ("p99", "max")] for k in range(minutes)],
    "every_minute_n": every_minute_n, "each_schedule_once_a_minute": each_once_a_minute,
    "fired_counter_per_minute": round((metric("w1", fired) - metric("w0", fired)) / window_min),
    "skipped": int(metric("w1", skipped) - metric("w0", skipped)),
    "schedules_gauge": int(metric("w1", "delayd_schedules")),
    "rss_mb": {
        "idle": round(idle_rss / 1024, 1), "after_puts": round(status_kb("puts", "VmRSS") / 1024, 1),
        "restarted": round(status_kb("restarted", "VmRSS") / 1024, 1) if restarted else None,
        "end": round(end_rss / 1024, 1), "peak": round(status_kb("w1", "VmHWM") / 1024, 1),
        "peak_before_restart": round(status_kb("puts", "VmHWM") / 1024, 1),
        "anon_idle": round(status_kb("idle", "RssAnon") / 1024, 1),
        "anon_end": round(status_kb("w1", "RssAnon") / 1024, 1),
    },
    "rss_bytes_per_schedule": round((end_rss - idle_rss) * 1024 / n),
    "rss_bytes_per_schedule_after_puts": round((status_kb("puts", "VmRSS") - idle_rss) * 1024 / n),
    "rss_bytes_per_schedule_restarted": (round((status_kb("restarted", "VmRSS") - idle_rss) * 1024 / n)
                                         if restarted else None),
    "cpu_s_per_minute": round((cpu_s("w1") - cpu_s("w0")) / window_min, 2),
    "disk_mb_per_minute": round((written("w1") - written("w0")) / 1e6 / window_min, 1),
    # Of which: the WAL, and the broker's stored messages (the rest: schedule segments, the schedule
    # table's files, dispatch logs, checkpoints).
    "wal_mb_per_minute": round((metric("w1", "delayd_wal_bytes_written_total")
                                - metric("w0", "delayd_wal_bytes_written_total")) / 1e6 / window_min, 1),
    "broker_mb_per_minute": round((metric("w1", 'delayd_broker_bytes{store="main"}')
                                   - metric("w0", 'delayd_broker_bytes{store="main"}')) / 1e6 / window_min, 1),
}
print(json.dumps(result))

r, hs = result, result["histogram_steady"]
label = f"{n:,} × `{'cron * * * * *' if kind == 'cron' else 'every 1m'}`" + (", restarted" if restarted else "")


def q4(name):
    x = lateness[name]
    return "–" if x is None else f"{x['p50']:g} / {x['p99']:g} / {x['p999']:g} / {x['max']:g}"


print(f"\n{disk_line}\n")
print("| schedules | metric | value |\n|---|---|---|")
rows = [
    ("created, schedules/s (PUT p50 / p99, ms)",
     f"{r['put']['schedules_per_s']:,} ({r['put']['latency_ms_p50']} / {r['put']['latency_ms_p99']})"),
    ("lateness at the consumer, p50 / p99 / p99.9 / max, ms", q4("received")),
    ("the same, firings written in time only", q4("received_written_in_time")),
    ("lateness at the sink call (delivered_at), p50 / p99 / p99.9 / max, ms", q4("handed_to_sink")),
    ("server histogram p50 / p99 / max, under ms", f"{hs['p50_le_ms']} / {hs['p99_le_ms']} / {hs['max_le_ms']}"),
    ("first firing (B1): lateness max at the consumer / at the sink call, ms",
     f"{(lateness['first_minute_received'] or {}).get('max', '–')} / "
     f"{(lateness['first_minute_handed_to_sink'] or {}).get('max', '–')}"),
    ("firings a minute (each schedule once a minute)",
     f"{' / '.join(f'{c:,}' for c in r['per_minute'])} ({'yes' if each_once_a_minute else 'NO'})"),
    ("written after their time (planner behind) / skipped", f"{written_late:,} / {r['skipped']:,}"),
    ("early / duplicates / not received", f"{r['early']} / {r['duplicates']} / {unreceived}"),
    ("RSS idle / after the PUTs / after the restart / at the end, MB",
     f"{r['rss_mb']['idle']} / {r['rss_mb']['after_puts']} / {r['rss_mb']['restarted'] or '–'} / "
     f"{r['rss_mb']['end']}"),
    ("RSS per schedule, bytes: after the PUTs / after the restart / at the end",
     f"{r['rss_bytes_per_schedule_after_puts']:,} / "
     f"{'–' if not restarted else format(r['rss_bytes_per_schedule_restarted'], ',')} / "
     f"{r['rss_bytes_per_schedule']:,}"),
    ("server CPU, s a minute", f"{r['cpu_s_per_minute']}"),
    ("disk written, MB a minute (of which the WAL / the broker)",
     f"{r['disk_mb_per_minute']} ({r['wal_mb_per_minute']} / {r['broker_mb_per_minute']})"),
]
for metric_name, value in rows:
    print(f"| {label} | {metric_name} | {value} |")
PY
