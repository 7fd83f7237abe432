#!/usr/bin/env bash
# delayd against the delay queues people build instead, on this machine, in one command:
#   benches/compare.sh            (as root: it installs Redis and PostgreSQL from Debian if missing)
# Starts Redis (appendonly yes, appendfsync always) and PostgreSQL (synchronous_commit on, fsync on) on
# private ports in a scratch dir on disk, and delayd (release build, fsync always); runs the same
# workloads against each with benches/loadgen.rs; prints the disk's own speed (dd with oflag=dsync: 4 KiB
# writes/s and MB/s with 1 MiB writes), then a markdown table with delayd/peer ratios.
#
# Workloads (WORKLOADS, space-separated, picks and orders them; default all, in this order):
#  the friendly mix, 100-byte bodies, each message due 1-10 s after its request is sent, consumed as it
#  comes due:
#   single, batch           one message per request at concurrency 64 / 1,000 per request at concurrency 8,
#                           as fast as each system takes them (N_SINGLE, N_BATCH messages);
#   single-5k, batch-50k    the same at a nominal offered load of 5,000 / 50,000 messages/s for 10 s, for
#                           lateness when nothing is overloaded;
#   rss                     N_RSS 100-byte messages due within 1-30 days, for memory (delayd and Redis;
#                           N_RSS=0 skips it);
#  the realistic mix, 1 KiB bodies due 1 min - 30 days ahead, so nothing comes due during the run (no
#  consumer): durable ingest, request latency and write amplification (bytes the target process caused
#  to be written to disk, from /proc/PID/io read once it has stopped writing before and after the run,
#  over messages × 1,024 body bytes; delayd's figure includes the WAL files it prepares ahead of use,
#  where it zero-fills them; none for PostgreSQL, which has no single process):
#   real-batch              1,000 messages per request at concurrency 8 (N_REAL_BATCH messages: a few
#                           seconds, so that delayd's filing and checkpoints fall inside the run, as
#                           under sustained load, rather than after a burst);
#   real-single             one message per request at concurrency 64 (N_REAL_SINGLE messages);
#                           each after a warm-up of N_REAL_WARMUP messages (batched, not measured) into
#                           the same fresh target, so that it is measured as a node that has been running
#                           is: delayd has WAL files to reuse and the month's segments exist, Redis its
#                           keys and AOF, PostgreSQL its WAL (loadgen recreates its table at each start)
#                           (N_REAL_WARMUP=0 measures from empty).
#
# Variables (defaults in brackets):
#   N_SINGLE [20000], N_BATCH [200000], N_RSS [10000000], N_REAL_BATCH [1000000], N_REAL_SINGLE [30000],
#   N_REAL_WARMUP [300000]  messages per workload, as above;
#   WORKLOADS [single batch single-5k batch-50k rss real-batch real-single]
#                           the workloads to run, in order;
#   TARGETS [delayd redis postgres cluster]
#                           the systems to run them against (a peer left out is not even started), e.g.
#                           WORKLOADS="real-batch real-single" TARGETS=delayd for a quick A/B. `cluster`
#                           is delayd as three members on this one machine and disk (DESIGN.md §10,
#                           election timeout 1 s), the load sent to the leader; its rows compare it with
#                           the single node of the same run, and its write amplification is the leader's
#                           own (each member writes about as much);
#   SLOW_DISK [unset]       1: build delayd with `--features slow-disk` and start it with
#                           DELAYD_SLOW_DISK_SYNC_US=SLOW_SYNC_US [300] (µs added before every fsync) and
#                           DELAYD_SLOW_DISK_WRITE_US_PER_MIB=SLOW_WRITE_US_PER_MIB [3400] (µs added per MiB
#                           of every write of 64 KiB or more), to play a slower disk on a fast one. Only
#                           delayd is slowed: Redis and PostgreSQL run on the real disk, unaffected, so
#                           the ratios then compare a slowed delayd with unslowed peers;
#   SERVER_BIN [target/release/delayd]
#                           the delayd binary to run (for an A/B against another build; it must have
#                           been built with the slow-disk feature when SLOW_DISK=1).
set -euo pipefail
cd "$(dirname "$0")/.."
N_SINGLE=${N_SINGLE:-20000}
N_BATCH=${N_BATCH:-200000}
N_RSS=${N_RSS:-10000000}
N_REAL_BATCH=${N_REAL_BATCH:-1000000}
N_REAL_SINGLE=${N_REAL_SINGLE:-30000}
N_REAL_WARMUP=${N_REAL_WARMUP:-300000}
WORKLOADS=${WORKLOADS:-single batch single-5k batch-50k rss real-batch real-single}
TARGETS=${TARGETS:-delayd redis postgres cluster}
SLOW_DISK=${SLOW_DISK:-}
SERVER_BIN=${SERVER_BIN:-target/release/delayd}
SLOW_SYNC_US=${SLOW_SYNC_US:-300}
SLOW_WRITE_US_PER_MIB=${SLOW_WRITE_US_PER_MIB:-3400}

for workload in $WORKLOADS; do
  case $workload in
    single | batch | single-5k | batch-50k | rss | real-batch | real-single) ;;
    *) echo "unknown workload $workload (single batch single-5k batch-50k rss real-batch real-single)" >&2; exit 2 ;;
  esac
done
for target in $TARGETS; do
  case $target in
    delayd | redis | postgres | cluster) ;;
    *) echo "unknown target $target (delayd redis postgres cluster)" >&2; exit 2 ;;
  esac
done
wants() { [[ " $TARGETS " == *" $1 "* ]]; }

if [ "$SLOW_DISK" = 1 ]; then
  FEATURES=(--features slow-disk)
  DELAYD_ENV=("DELAYD_SLOW_DISK_SYNC_US=$SLOW_SYNC_US" "DELAYD_SLOW_DISK_WRITE_US_PER_MIB=$SLOW_WRITE_US_PER_MIB")
  SEAM="on (sync +$SLOW_SYNC_US µs, +$SLOW_WRITE_US_PER_MIB µs/MiB; delayd only, peers unaffected)"
else
  FEATURES=()
  DELAYD_ENV=()
  SEAM=off
fi

if { wants redis && ! command -v redis-server >/dev/null; } ||
  { wants postgres && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; }; then
  apt-get update -qq && apt-get install -y -qq redis-server postgresql >/dev/null
fi
WORK=$(mktemp -d /var/tmp/delayd-compare.XXXXXX)
chmod 755 "$WORK"
STARTED_REDIS= STARTED_PG=
cleanup() {
  [ -n "$STARTED_REDIS" ] && { redis-cli -p 6399 shutdown nosave >/dev/null 2>&1 || true; }
  [ -n "$STARTED_PG" ] && { su postgres -c "$PGBIN/pg_ctl -D $WORK/pg/data stop -m immediate" >/dev/null 2>&1 || true; }
  [ -n "${DELAYD_PID:-}" ] && kill "$DELAYD_PID" 2>/dev/null || true
  for pid in ${MEMBER_PIDS:-}; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# The disk itself, in the scratch dir the systems will write to (benches/disk.sh).
echo "== disk" >&2
DD_1M_COUNT=256 . benches/disk.sh
DISK_LINE="$DISK_LINE; slow-disk seam: $SEAM"
echo "$DISK_LINE" >&2

. benches/build.sh
# Last, so that target/release/delayd is the build asked for (with the slow-disk seam or without).
cargo build --release --bin delayd "${FEATURES[@]}" -q 2>/dev/null || cargo build --release --bin delayd "${FEATURES[@]}"

if wants redis; then
  mkdir -p "$WORK/redis"
  redis-server --port 6399 --dir "$WORK/redis" --appendonly yes --appendfsync always --save '' \
    --daemonize yes --pidfile "$WORK/redis.pid" --logfile "$WORK/redis.log"
  STARTED_REDIS=1
  for _ in $(seq 50); do redis-cli -p 6399 ping >/dev/null 2>&1 && break; sleep 0.1; done
  for _ in $(seq 50); do [ -s "$WORK/redis.pid" ] && break; sleep 0.1; done
fi
if wants postgres; then
  PGBIN=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  mkdir -p "$WORK/pg"
  chown postgres "$WORK/pg"
  su postgres -c "$PGBIN/initdb -D $WORK/pg/data -A trust" >/dev/null
  STARTED_PG=1
  su postgres -c "$PGBIN/pg_ctl -D $WORK/pg/data -l $WORK/pg/log -w start \
    -o '-p 5499 -k $WORK/pg -c listen_addresses=127.0.0.1 -c synchronous_commit=on -c fsync=on -c max_connections=200'" >/dev/null
fi

start_delayd() {
  [ -n "${DELAYD_PID:-}" ] && { kill "$DELAYD_PID"; wait "$DELAYD_PID" 2>/dev/null || true; }
  rm -rf "$WORK/delayd"
  # `env` execs delayd, so $! is delayd's own pid (for its RSS and /proc/PID/io).
  env "${DELAYD_ENV[@]}" "$SERVER_BIN" serve --data-dir "$WORK/delayd" --listen 127.0.0.1:7399 \
    >"$WORK/delayd.out" 2>"$WORK/delayd.log" &
  DELAYD_PID=$!
  for _ in $(seq 100); do
    grep -q listening "$WORK/delayd.out" && return
    [ "$(sed 's/.*) //' "/proc/$DELAYD_PID/stat" 2>/dev/null | cut -c1)" = Z ] && break # exited
    sleep 0.1
  done
  echo "delayd did not start:" >&2
  cat "$WORK/delayd.out" "$WORK/delayd.log" >&2
  exit 1
}
# Three members on ports 7391-7393 (peers 7381-7383), fresh data dirs; sets CLUSTER_URL and
# CLUSTER_PID to the leader's once every member knows it.
start_cluster() {
  for pid in ${MEMBER_PIDS:-}; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  MEMBER_PIDS=
  rm -rf "$WORK/cluster"
  mkdir -p "$WORK/cluster"
  local roster="" id
  for id in 1 2 3; do
    roster+=$'[[cluster.members]]\n'"id = $id"$'\n'"api = \"http://127.0.0.1:739$id\""$'\n'"peer = \"127.0.0.1:738$id\""$'\n'
  done
  for id in 1 2 3; do
    printf 'listen = "127.0.0.1:739%s"\n[cluster]\nnode_id = %s\nlisten = "127.0.0.1:738%s"\nsecret = "compare.sh cluster secret, not for production"\nelection_timeout = "1s"\n%s' \
      "$id" "$id" "$id" "$roster" >"$WORK/cluster/$id.toml"
    env "${DELAYD_ENV[@]}" "$SERVER_BIN" serve --config "$WORK/cluster/$id.toml" --data-dir "$WORK/cluster/$id" \
      >"$WORK/cluster/$id.out" 2>"$WORK/cluster/$id.log" &
    MEMBER_PIDS+=" $!"
  done
  local leader=
  for _ in $(seq 300); do
    leader=$(curl -fsS http://127.0.0.1:7391/v1/cluster 2>/dev/null | sed -nE 's/.*"leader_id":([0-9]+).*/\1/p')
    [ -n "$leader" ] && curl -fsS "http://127.0.0.1:739$leader/readyz" >/dev/null 2>&1 && break
    sleep 0.1
  done
  [ -n "$leader" ] || { echo "the cluster elected no leader:" >&2; cat "$WORK"/cluster/*.out >&2; exit 1; }
  CLUSTER_URL=http://127.0.0.1:739$leader
  CLUSTER_PID=$(echo $MEMBER_PIDS | cut -d' ' -f"$leader")
}
# The process whose peak RSS and disk writes are reported, with its peak RSS reset first. None for
# PostgreSQL: its memory and writes are spread over a process per connection plus the WAL writer,
# checkpointer and background writer, and no one process stands for it.
pid_args() {
  local pid
  case $1 in
    delayd) pid=$DELAYD_PID ;;
    cluster) pid=$CLUSTER_PID ;;
    redis) pid=$(cat "$WORK/redis.pid") ;;
    *) return ;;
  esac
  echo 5 >"/proc/$pid/clear_refs"
  echo --pid "$pid"
}

RESULTS="$WORK/results.jsonl"
: >"$RESULTS"
FRIENDLY=(--delay-min-ms 1000 --delay-max-ms 10000)
REAL=(--body-bytes 1024 --delay-min-ms 60000 --delay-max-ms 2592000000 --no-consume)
for workload in $WORKLOADS; do
  targets=$TARGETS
  case $workload in
    single) args=(--mode single --concurrency 64 --messages "$N_SINGLE" "${FRIENDLY[@]}") ;;
    batch) args=(--mode batch --batch 1000 --concurrency 8 --messages "$N_BATCH" "${FRIENDLY[@]}") ;;
    single-5k) args=(--mode single --concurrency 64 --messages 50000 --rate 5000 "${FRIENDLY[@]}") ;;
    batch-50k) args=(--mode batch --batch 1000 --concurrency 8 --messages 500000 --rate 50000 "${FRIENDLY[@]}") ;;
    rss)
      [ "$N_RSS" -gt 0 ] || continue
      targets=$(for t in delayd redis; do wants $t && echo $t; done)
      args=(--mode batch --batch 1000 --concurrency 8 --messages "$N_RSS" --delay-min-ms 86400000
        --delay-max-ms 2592000000 --no-consume)
      ;;
    real-batch) args=(--mode batch --batch 1000 --concurrency 8 --messages "$N_REAL_BATCH" "${REAL[@]}") ;;
    real-single) args=(--mode single --concurrency 64 --messages "$N_REAL_SINGLE" "${REAL[@]}") ;;
  esac
  for target in $targets; do
    [ "$workload" = rss ] && [ "$target" = cluster ] && continue
    url=http://127.0.0.1:7399 kind=$target
    [ "$target" = delayd ] && start_delayd
    [ "$target" = cluster ] && { start_cluster; url=$CLUSTER_URL kind=delayd; }
    [ "$target" = redis ] && redis-cli -p 6399 flushall >/dev/null
    if [[ $workload == real-* && $N_REAL_WARMUP -gt 0 ]]; then
      echo "== $workload / $target: warm-up, $N_REAL_WARMUP messages" >&2
      "$LOADGEN" --target "$kind" --url "$url" --mode batch --batch 1000 --concurrency 8 \
        --messages "$N_REAL_WARMUP" "${REAL[@]}" --label warmup >/dev/null
    fi
    echo "== $workload / $target" >&2
    "$LOADGEN" --target "$kind" --url "$url" "${args[@]}" $(pid_args "$target") \
      --label "$workload" | sed "s/\"target\":\"$kind\"/\"target\":\"$target\"/" >>"$RESULTS"
  done
done

mkdir -p target && cp "$RESULTS" target/compare-results.jsonl
echo
echo "$DISK_LINE"
echo
SLOW_DISK="$SLOW_DISK" python3 - "$RESULTS" <<'EOF'
import json, os, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {(r["label"], r["target"]): r for r in rows}
labels = {r["label"] for r in rows}
def get(label, target, *path):
    v = by.get((label, target))
    for p in path:
        v = None if v is None else v.get(p)
    return v
def fmt(v):
    if v is None: return "–"
    if isinstance(v, float) and v != int(v): return f"{v:,.1f}"
    return f"{int(v):,}"
def fmt2(v):
    return "–" if v is None else f"{v:,.2f}"
def ratio(a, b, higher_is_better=True):
    if not a or not b: return "–"
    return f"{a / b:.1f}×" if higher_is_better else f"{b / a:.1f}×"
delayd = "delayd (slow-disk seam; peers unaffected)" if os.environ.get("SLOW_DISK") == "1" else "delayd"
print(f"| workload | metric | {delayd} | Redis | PostgreSQL | delayd vs Redis | delayd vs PostgreSQL |")
print("|---|---|---|---|---|---|---|")
full = [("durable ingest, msg/s", ("ingest_per_sec",), True),
        ("request latency p50, ms", ("request_latency_ms", "p50"), False),
        ("request latency p99, ms", ("request_latency_ms", "p99"), False)]
nominal = [("request latency p99, ms", ("request_latency_ms", "p99"), False)]
delivery = [("lateness p50, ms", ("lateness_ms", "p50"), False),
            ("lateness p99, ms", ("lateness_ms", "p99"), False),
            ("lateness max, ms", ("lateness_ms", "max"), False),
            ("early / duplicates / lost", None, None),
            ("peak RSS, MB", ("peak_rss_mb",), False)]
real = full + [("write amplification (disk bytes / body bytes)", ("write_amplification",), False)]
for label, name, metrics in [("single", "1 message/request, concurrency 64", full + delivery),
                             ("batch", "1,000 messages/request, concurrency 8", full + delivery),
                             ("single-5k", "1 message/request, 5,000 msg/s offered", nominal + delivery),
                             ("batch-50k", "1,000 messages/request, 50,000 msg/s offered", nominal + delivery),
                             ("real-batch", "1 KiB due 1 min–30 days, 1,000 messages/request, concurrency 8", real),
                             ("real-single", "1 KiB due 1 min–30 days, 1 message/request, concurrency 64", real)]:
    if label not in labels:
        continue
    for metric, path, better in metrics:
        if path is None:
            cells = [f'{get(label, t, "early")}/{get(label, t, "duplicates")}/{get(label, t, "lost")}' for t in ("delayd", "redis", "postgres")]
            print(f"| {name} | {metric} | " + " | ".join(cells) + " | | |")
            continue
        d, r, p = (get(label, t, *path) for t in ("delayd", "redis", "postgres"))
        f = fmt2 if path == ("write_amplification",) else fmt
        print(f"| {name} | {metric} | {f(d)} | {f(r)} | {f(p)} | {ratio(d, r, better)} | {ratio(d, p, better)} |")
if any(t == "cluster" for (_, t) in by):
    print()
    print("| workload | metric | cluster of 3 (one machine, one disk) | single node | cluster / single |")
    print("|---|---|---|---|---|")
    for label, name, metrics in [("single", "1 message/request, concurrency 64", full),
                                 ("batch", "1,000 messages/request, concurrency 8", full),
                                 ("real-batch", "1 KiB due 1 min–30 days, 1,000 messages/request", real),
                                 ("real-single", "1 KiB due 1 min–30 days, 1 message/request", real)]:
        if (label, "cluster") not in by:
            continue
        for metric, path, better in metrics:
            c, d = get(label, "cluster", *path), get(label, "delayd", *path)
            f = fmt2 if path == ("write_amplification",) else fmt
            share = f"{100 * c / d:.0f} %" if c and d else "–"
            print(f"| {name} | {metric} | {f(c)} | {f(d)} | {share} |")
if ("rss", "delayd") in by or ("rss", "redis") in by:
    d, r = get("rss", "delayd", "peak_rss_mb"), get("rss", "redis", "peak_rss_mb")
    n = (by.get(("rss", "delayd")) or by[("rss", "redis")])["messages"]
    share = f"{100 * d / r:.1f} % of Redis" if d and r else "–"
    print(f"| {n:,} messages due within 30 days | peak RSS, MB | {fmt(d)} | {fmt(r)} | – | {share} | |")
    print(f"| {n:,} messages due within 30 days | ingest, msg/s | {fmt(get('rss', 'delayd', 'ingest_per_sec'))} | {fmt(get('rss', 'redis', 'ingest_per_sec'))} | – | {ratio(get('rss', 'delayd', 'ingest_per_sec'), get('rss', 'redis', 'ingest_per_sec'))} | |")
EOF
