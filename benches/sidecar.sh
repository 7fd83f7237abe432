#!/usr/bin/env bash
# delayd as a Redis Streams sidecar against delayd over HTTP, same messages, on this machine:
#   benches/sidecar.sh            (as root: installs Redis from Debian if missing)
# Starts a durable Redis (appendonly yes, appendfsync always) on port 6398 and a fresh delayd (release
# build, fsync always) with a Redis source (stream delayd:in) and sink for each run, then drives with
# benches/loadgen.rs:
#   http-batch       1,000 messages per HTTP request, concurrency 8, as fast as delayd takes them;
#   sidecar          the same messages XADDed to delayd:in, pipelined 1,000 per round trip, concurrency 8,
#                    counted as ingested once delayd has acknowledged them (XACK after its fsync);
#   sidecar-10k      the sidecar path at a nominal 10,000 requests/s for 10 s, for lateness.
# Bodies are BODY_BYTES (1 KiB) and due 1-10 s after sending. Prints one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-100000}
BODY_BYTES=${BODY_BYTES:-1024}
command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
WORK=$(mktemp -d /var/tmp/delayd-sidecar.XXXXXX)
cleanup() {
  redis-cli -p 6398 shutdown nosave >/dev/null 2>&1 || true
  [ -n "${DELAYD_PID:-}" ] && kill "$DELAYD_PID" 2>/dev/null || true
  wait 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
cargo build --release --benches -q 2>/dev/null || cargo build --release --benches
LOADGEN=$(ls -t target/release/deps/loadgen-* | grep -v '\.d$' | head -1)
cat >"$WORK/delayd.toml" <<TOML
[sinks.out]
kind = "redis"
url = "redis://127.0.0.1:6398/"
max_in_flight = 8

[sources.in]
kind = "redis"
url = "redis://127.0.0.1:6398/"
stream_key = "delayd:in"
sink = "out"
batch = 1024
TOML

start() {
  [ -n "${DELAYD_PID:-}" ] && { kill "$DELAYD_PID"; wait "$DELAYD_PID" 2>/dev/null || true; }
  redis-cli -p 6398 shutdown nosave >/dev/null 2>&1 || true
  rm -rf "$WORK/delayd" "$WORK/redis" && mkdir -p "$WORK/redis"
  redis-server --port 6398 --dir "$WORK/redis" --appendonly yes --appendfsync always --save '' \
    --daemonize yes --logfile "$WORK/redis.log"
  for _ in $(seq 50); do redis-cli -p 6398 ping >/dev/null 2>&1 && break; sleep 0.1; done
  target/release/delayd serve --data-dir "$WORK/delayd" --listen 127.0.0.1:7398 --config "$WORK/delayd.toml" \
    >"$WORK/delayd.out" 2>"$WORK/delayd.log" &
  DELAYD_PID=$!
  for _ in $(seq 100); do grep -q "delayd ready" "$WORK/delayd.out" && break; sleep 0.1; done
}
common=(--url http://127.0.0.1:7398 --redis-url redis://127.0.0.1:6398/ --body-bytes "$BODY_BYTES"
  --delay-min-ms 1000 --delay-max-ms 10000)
start
"$LOADGEN" --target delayd --mode batch --batch 1000 --concurrency 8 --messages "$N" "${common[@]}" --label http-batch
start
"$LOADGEN" --target delayd-redis --mode batch --batch 1000 --concurrency 8 --messages "$N" "${common[@]}" --label sidecar
start
"$LOADGEN" --target delayd-redis --mode batch --batch 100 --concurrency 8 --messages 100000 --rate 10000 \
  "${common[@]}" --label sidecar-10k
