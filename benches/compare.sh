#!/usr/bin/env bash
# delayd against the delay queues people build instead, on this machine, in one command:
#   benches/compare.sh            (as root: it installs Redis and PostgreSQL from Debian if missing)
# Starts Redis (appendonly yes, appendfsync always) and PostgreSQL (synchronous_commit on, fsync on) on
# private ports in a scratch dir on disk, and delayd (release build, fsync always); runs the same
# workloads against each with benches/loadgen.rs; prints a markdown table with delayd/peer ratios.
# Workloads, each message due 1-10 s after its request is sent:
#   single, batch           one message per request at concurrency 64 / 1,000 per request at concurrency 8,
#                           as fast as each system takes them (N_SINGLE, N_BATCH messages);
#   single-5k, batch-50k    the same at a nominal offered load of 5,000 / 50,000 messages/s for 10 s, for
#                           lateness when nothing is overloaded;
#   rss                     N_RSS messages due within 30 days, for memory (delayd and Redis; 0 skips it).
set -euo pipefail
cd "$(dirname "$0")/.."
N_SINGLE=${N_SINGLE:-20000}
N_BATCH=${N_BATCH:-200000}
N_RSS=${N_RSS:-10000000}

if ! command -v redis-server >/dev/null || ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq redis-server postgresql >/dev/null
fi
PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
WORK=$(mktemp -d /var/tmp/delayd-compare.XXXXXX)
chmod 755 "$WORK"
cleanup() {
  redis-cli -p 6399 shutdown nosave >/dev/null 2>&1 || true
  su postgres -c "$PGBIN/pg_ctl -D $WORK/pg/data stop -m immediate" >/dev/null 2>&1 || true
  [ -n "${DELAYD_PID:-}" ] && kill "$DELAYD_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

cargo build --release --benches -q 2>/dev/null || cargo build --release --benches
LOADGEN=$(ls -t target/release/deps/loadgen-* | grep -v '\.d$' | head -1)

mkdir -p "$WORK/redis" "$WORK/pg"
redis-server --port 6399 --dir "$WORK/redis" --appendonly yes --appendfsync always --save '' \
  --daemonize yes --pidfile "$WORK/redis.pid" --logfile "$WORK/redis.log"
chown postgres "$WORK/pg"
su postgres -c "$PGBIN/initdb -D $WORK/pg/data -A trust" >/dev/null
su postgres -c "$PGBIN/pg_ctl -D $WORK/pg/data -l $WORK/pg/log -w start \
  -o '-p 5499 -k $WORK/pg -c listen_addresses=127.0.0.1 -c synchronous_commit=on -c fsync=on -c max_connections=200'" >/dev/null
for _ in $(seq 50); do redis-cli -p 6399 ping >/dev/null 2>&1 && break; sleep 0.1; done

start_delayd() {
  [ -n "${DELAYD_PID:-}" ] && { kill "$DELAYD_PID"; wait "$DELAYD_PID" 2>/dev/null || true; }
  rm -rf "$WORK/delayd"
  target/release/delayd serve --data-dir "$WORK/delayd" --listen 127.0.0.1:7399 >"$WORK/delayd.out" 2>"$WORK/delayd.log" &
  DELAYD_PID=$!
  for _ in $(seq 100); do grep -q listening "$WORK/delayd.out" && break; sleep 0.1; done
}
# The process whose peak RSS is reported, with its peak reset first. None for PostgreSQL: its memory is
# spread over a process per connection sharing its buffers, and no one process's peak stands for it.
pid_args() {
  local pid
  case $1 in
    delayd) pid=$DELAYD_PID ;;
    redis) pid=$(cat "$WORK/redis.pid") ;;
    *) return ;;
  esac
  echo 5 >"/proc/$pid/clear_refs"
  echo --pid "$pid"
}

RESULTS="$WORK/results.jsonl"
for workload in single batch single-5k batch-50k; do
  case $workload in
    single) args=(--mode single --concurrency 64 --messages "$N_SINGLE") ;;
    batch) args=(--mode batch --batch 1000 --concurrency 8 --messages "$N_BATCH") ;;
    single-5k) args=(--mode single --concurrency 64 --messages 50000 --rate 5000) ;;
    batch-50k) args=(--mode batch --batch 1000 --concurrency 8 --messages 500000 --rate 50000) ;;
  esac
  for target in delayd redis postgres; do
    [ "$target" = delayd ] && start_delayd
    [ "$target" = redis ] && redis-cli -p 6399 flushall >/dev/null
    echo "== $workload / $target" >&2
    "$LOADGEN" --target "$target" --url http://127.0.0.1:7399 "${args[@]}" --delay-min-ms 1000 \
      --delay-max-ms 10000 $(pid_args "$target") --label "$workload" >>"$RESULTS"
  done
done

if [ "$N_RSS" -gt 0 ]; then
  for target in delayd redis; do
    [ "$target" = delayd ] && start_delayd
    [ "$target" = redis ] && redis-cli -p 6399 flushall >/dev/null
    echo "== memory / $target" >&2
    "$LOADGEN" --target "$target" --url http://127.0.0.1:7399 --mode batch --batch 1000 --concurrency 8 \
      --messages "$N_RSS" --delay-min-ms 86400000 --delay-max-ms 2592000000 --no-consume \
      $(pid_args "$target") --label rss >>"$RESULTS"
  done
fi

mkdir -p target && cp "$RESULTS" target/compare-results.jsonl
python3 - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {(r["label"], r["target"]): r for r in rows}
def get(label, target, *path):
    v = by.get((label, target))
    for p in path:
        v = None if v is None else v.get(p)
    return v
def fmt(v):
    if v is None: return "–"
    if isinstance(v, float) and v != int(v): return f"{v:,.1f}"
    return f"{int(v):,}"
def ratio(a, b, higher_is_better=True):
    if not a or not b: return "–"
    return f"{a / b:.1f}×" if higher_is_better else f"{b / a:.1f}×"
print("| workload | metric | delayd | Redis | PostgreSQL | delayd vs Redis | delayd vs PostgreSQL |")
print("|---|---|---|---|---|---|---|")
full = [("durable ingest, msg/s", ("ingest_per_sec",), True),
        ("request latency p50, ms", ("request_latency_ms", "p50"), False),
        ("request latency p99, ms", ("request_latency_ms", "p99"), False)]
nominal = [("request latency p99, ms", ("request_latency_ms", "p99"), False)]
for label, name, first in [("single", "1 message/request, concurrency 64", full),
                           ("batch", "1,000 messages/request, concurrency 8", full),
                           ("single-5k", "1 message/request, 5,000 msg/s offered", nominal),
                           ("batch-50k", "1,000 messages/request, 50,000 msg/s offered", nominal)]:
    for metric, path, better in first + [
                                 ("lateness p50, ms", ("lateness_ms", "p50"), False),
                                 ("lateness p99, ms", ("lateness_ms", "p99"), False),
                                 ("lateness max, ms", ("lateness_ms", "max"), False),
                                 ("early / duplicates / lost", None, None),
                                 ("peak RSS, MB", ("peak_rss_mb",), False)]:
        if path is None:
            cells = [f'{get(label, t, "early")}/{get(label, t, "duplicates")}/{get(label, t, "lost")}' for t in ("delayd", "redis", "postgres")]
            print(f"| {name} | {metric} | " + " | ".join(cells) + " | | |")
            continue
        d, r, p = (get(label, t, *path) for t in ("delayd", "redis", "postgres"))
        print(f"| {name} | {metric} | {fmt(d)} | {fmt(r)} | {fmt(p)} | {ratio(d, r, better)} | {ratio(d, p, better)} |")
if ("rss", "delayd") in by:
    d, r = get("rss", "delayd", "peak_rss_mb"), get("rss", "redis", "peak_rss_mb")
    n = by[("rss", "delayd")]["messages"]
    share = f"{100 * d / r:.1f} % of Redis" if d and r else "–"
    print(f"| {n:,} messages due within 30 days | peak RSS, MB | {fmt(d)} | {fmt(r)} | – | {share} | |")
    print(f"| {n:,} messages due within 30 days | ingest, msg/s | {fmt(get('rss', 'delayd', 'ingest_per_sec'))} | {fmt(get('rss', 'redis', 'ingest_per_sec'))} | – | {ratio(get('rss', 'delayd', 'ingest_per_sec'), get('rss', 'redis', 'ingest_per_sec'))} | |")
EOF
