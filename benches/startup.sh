#!/usr/bin/env bash
# What a start costs a node that holds many pending messages: its time to ready and its memory.
#   benches/startup.sh                         N (2,000,000) messages of BODY_BYTES (1 KiB) due over
#   N=200000 BIN=/path/to/old/delayd ...       30 days, scheduled over HTTP; KEYED=1: each with an
#   KEYED=1 benches/startup.sh                 idempotency key of its own (`dedup`), one a request
# The node has an MQ source that takes no requests (a Redis Streams source, its redis-server started
# here) beside the messages sent over HTTP: the start reads back what the source wrote since its mark,
# and rebuilds the index of idempotency keys from the pending keyed messages. Once every message is
# durable the node is left alone for 15 s (a quiet source saves its mark every 10 s), stopped (SIGTERM),
# and started again; printed: the seconds from the start to `delayd ready` and to the source being
# connected, the peak RSS of that start (VmHWM) and the RSS 10 s after it, as one JSON line. BIN picks
# the binary (an older build, for a before/after); the data dir, under /var/tmp, is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-2000000}
BODY_BYTES=${BODY_BYTES:-1024}
KEYED=${KEYED:-0}
BIN=${BIN:-target/release/delayd}
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
. benches/build.sh
WORK=$(mktemp -d /var/tmp/delayd-startup.XXXXXX)
PORT=7399 REDIS_PORT=6397
DELAYD_PID=
cleanup() {
  [ -n "$DELAYD_PID" ] && { kill -9 "$DELAYD_PID" 2>/dev/null || true; wait "$DELAYD_PID" 2>/dev/null || true; }
  redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
redis-server --port "$REDIS_PORT" --dir "$WORK" --save '' --daemonize yes --logfile "$WORK/redis.log"
cat >"$WORK/delayd.toml" <<TOML
[sinks.out]
kind = "redis"
url = "redis://127.0.0.1:$REDIS_PORT/"

[sources.in]
kind = "redis"
url = "redis://127.0.0.1:$REDIS_PORT/"
stream_key = "delayd:in"
consumer = "bench"
sink = "out"
TOML
start() {
  "$BIN" serve --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" --config "$WORK/delayd.toml" \
    >"$WORK/delayd.out" 2>"$WORK/delayd.log" &
  DELAYD_PID=$!
}
connected() {
  curl -sf "http://127.0.0.1:$PORT/v1/sources" 2>/dev/null | grep -q '"connected":true'
}
start
for _ in $(seq 600); do grep -q "delayd ready" "$WORK/delayd.out" && break; sleep 0.1; done
mode=(--mode batch --batch 1000 --concurrency 8)
[ "$KEYED" = 1 ] && mode=(--mode single --concurrency 32 --keyed)
"$LOADGEN" --target delayd --url "http://127.0.0.1:$PORT" --messages "$N" "${mode[@]}" \
  --body-bytes "$BODY_BYTES" --delay-min-ms 3600000 --delay-max-ms 2592000000 --no-consume \
  --label load >/dev/null
sleep 15
kill -TERM "$DELAYD_PID"
wait "$DELAYD_PID" || true
started=$(date +%s.%N)
start
ready= source=
for _ in $(seq 6000); do
  if [ -z "$ready" ] && grep -q "delayd ready" "$WORK/delayd.out"; then ready=$(date +%s.%N); fi
  if [ -n "$ready" ] && connected; then source=$(date +%s.%N); break; fi
  kill -0 "$DELAYD_PID" 2>/dev/null || { echo "delayd exited: $(tail -3 "$WORK/delayd.log")" >&2; exit 1; }
  sleep 0.05
done
sleep 10
status=/proc/$DELAYD_PID/status
hwm=$(awk '/VmHWM/ {print $2}' "$status")
rss=$(awk '/VmRSS/ {print $2}' "$status")
python3 - "$N" "$KEYED" "$BIN" "$started" "$ready" "$source" "$hwm" "$rss" <<'PY'
import json, sys
n, keyed, binary, started, ready, source, hwm, rss = sys.argv[1:]
print(json.dumps({
    "messages": int(n), "keyed": keyed == "1", "binary": binary,
    "ready_s": round(float(ready) - float(started), 2),
    "source_connected_s": round(float(source) - float(started), 2) if source else None,
    "peak_rss_mb": round(int(hwm) / 1024), "rss_after_10s_mb": round(int(rss) / 1024),
}))
PY
