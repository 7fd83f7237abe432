#!/usr/bin/env bash
# What a start costs a node whose built-in broker holds many messages, after a SIGKILL amid deliveries:
#   benches/broker_start.sh                  N (1,000,000) messages of BODY_BYTES (1 KiB), due at once,
#   N=200000 BIN=/path/to/old/delayd ...     scheduled over HTTP and delivered into the broker (nobody
#                                            consumes); then a wave of WAVE (50,000) more, due 2-3 s later,
# and SIGKILL once half the wave is stored: the start after it reads the broker's commit log from its
# checkpoint (from 2026-12-05 also from its floor, and looks up the outcomes of the deliveries after it:
# src/broker/outcomes.rs). Then a SIGTERM and a clean start. Printed, as one JSON line: the seconds from
# each start to `delayd ready`, the messages the broker stored (N + WAVE when each is stored once) and
# `delayd_broker_reconciled_total` after the kill, the reconciliation's time and the part of it spent
# recording outcomes (`reconcile_ms`, `recording_ms`, from its log line; null from a build without
# it), and the disk's own speed (benches/disk.sh). BIN picks the binary (an older build, for a
# before/after); the data dir, under /var/tmp, is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-1000000}
WAVE=${WAVE:-50000}
BODY_BYTES=${BODY_BYTES:-1024}
BIN=${BIN:-target/release/delayd}
. benches/build.sh
[ "$BIN" = target/release/delayd ] && cargo build --release --bin delayd -q
WORK=$(mktemp -d /var/tmp/delayd-broker-start.XXXXXX)
PORT=7398 URL=http://127.0.0.1:7398
DELAYD_PID= LOAD_PID=
cleanup() {
  [ -n "$LOAD_PID" ] && { kill "$LOAD_PID" 2>/dev/null || true; wait "$LOAD_PID" 2>/dev/null || true; }
  [ -n "$DELAYD_PID" ] && { kill -9 "$DELAYD_PID" 2>/dev/null || true; wait "$DELAYD_PID" 2>/dev/null || true; }
  rm -rf "$WORK"
}
trap cleanup EXIT
. benches/disk.sh
start() { # start; sets READY_S, the seconds to `delayd ready`
  local started ready
  : >"$WORK/delayd.out"
  started=$(date +%s.%N)
  "$BIN" serve --data-dir "$WORK/data" --listen "127.0.0.1:$PORT" >"$WORK/delayd.out" 2>>"$WORK/delayd.log" &
  DELAYD_PID=$!
  for _ in $(seq 12000); do
    if grep -q "delayd ready" "$WORK/delayd.out"; then
      ready=$(date +%s.%N)
      READY_S=$(python3 -c "print(round($ready - $started, 2))")
      return
    fi
    kill -0 "$DELAYD_PID" 2>/dev/null || { echo "delayd exited: $(tail -3 "$WORK/delayd.log")" >&2; exit 1; }
    sleep 0.05
  done
  echo "delayd not ready within 10 minutes" >&2; exit 1
}
stored() { # messages in the broker topic, over its queues
  curl -sf "$URL/v1/topics/loadgen" 2>/dev/null |
    python3 -c 'import json,sys; print(sum(q["max_offset"] for q in json.load(sys.stdin)["queues"]))' 2>/dev/null || echo 0
}
wait_stored() { # wait_stored COUNT
  for _ in $(seq 6000); do [ "$(stored)" -ge "$1" ] && return; sleep 0.2; done
  echo "the broker did not reach $1 messages" >&2; exit 1
}
load() { # load COUNT DELAY_MIN_MS DELAY_MAX_MS
  "$LOADGEN" --target delayd --url "$URL" --messages "$1" --mode batch --batch 1000 --concurrency 8 \
    --body-bytes "$BODY_BYTES" --delay-min-ms "$2" --delay-max-ms "$3" --no-consume --label load >/dev/null
}
start
load "$N" 0 1
wait_stored "$N"
load "$WAVE" 2000 3000 &
LOAD_PID=$!
wait "$LOAD_PID"; LOAD_PID=
wait_stored $((N + WAVE / 2))
kill -9 "$DELAYD_PID"; wait "$DELAYD_PID" 2>/dev/null || true
start
after_kill=$READY_S
logged() { grep -o "$1=[0-9]*" "$WORK/delayd.out" | tail -1 | cut -d= -f2 || true; }
reconcile_ms=$(logged elapsed_ms) recording_ms=$(logged recording_ms)
wait_stored $((N + WAVE))
sleep 3 # anything repeated arrives meanwhile
reconciled=$(curl -sf "$URL/metrics" | awk '/^delayd_broker_reconciled_total/ {print $2}')
total=$(stored)
kill -TERM "$DELAYD_PID"; wait "$DELAYD_PID" || true
start
after_stop=$READY_S
printf '{"binary": "%s", "broker_messages": %d, "wave": %d, "ready_after_kill_s": %s, "ready_after_stop_s": %s, "stored": %d, "stored_twice": %d, "reconciled": %s, "reconcile_ms": %s, "recording_ms": %s, "disk": "%s"}\n' \
  "$BIN" "$N" "$WAVE" "$after_kill" "$after_stop" "$total" $((total - N - WAVE)) "${reconciled:-null}" "${reconcile_ms:-null}" "${recording_ms:-null}" "$DISK_LINE"
