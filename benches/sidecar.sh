#!/usr/bin/env bash
# delayd as an MQ sidecar (Redis Streams, NATS JetStream, RabbitMQ) against delayd over HTTP, same
# messages, on this machine:
#   benches/sidecar.sh            (as root: installs redis-server, nats-server and rabbitmq-server from
#   N=50000 benches/sidecar.sh     Debian if missing; N = messages of the as-fast-as-possible runs;
#   RUNS="sidecar nats" ...        RUNS = the runs to do, by label, all by default)
# Builds the release binaries, then for each run starts a fresh MQ server (fresh state, in a scratch dir
# removed at the end) and a fresh delayd (fsync always) whose source and sink are on that MQ, and drives
# it with benches/loadgen.rs:
#   http-batch       1,000 messages per HTTP request, concurrency 8, as fast as delayd takes them;
#   sidecar          Redis: the same messages XADDed to delayd:in, pipelined 1,000 per round trip,
#                    concurrency 8, counted as ingested once delayd has acknowledged them (XACK after
#                    its fsync); read from the target stream loadgen:out;
#   sidecar-10k      the Redis path at a nominal 10,000 messages/s for 10 s (batches of 100), for lateness;
#   nats, nats-10k   the same two workloads through NATS JetStream (nats-server -js, port 4298):
#                    published to delayd.in (stream DELAYS), 1,000 PubAcks awaited per batch, ingested
#                    once delayd's durable consumer has been handed and has acknowledged every request;
#                    read from stream LOADGEN_OUT (subject loadgen.out). nats-server's JetStream store
#                    syncs to disk every 2 minutes by default (sync_interval), not per PubAck;
#   amqp, amqp-10k   the same through RabbitMQ (port 5698, as the rabbitmq user): persistent messages on
#                    confirming channels to queue delayd.in, 1,000 confirms awaited per batch, ingested
#                    once the queue has nothing ready and delayd counts every request durable (its
#                    metrics: AMQP does not tell a client a queue's unacknowledged count); read from
#                    queue loadgen.out.
#   amqp-5k          RabbitMQ at a nominal 5,000 requests/s (at 10,000 it is near its own ceiling here);
#   kafka-500        the same through a Kafka-protocol broker at a nominal 500 requests/s (batches of
#                    50), for lateness: the rate this machine's broker sustains (below).
#   kafka, kafka-10k NOT IN THE DEFAULT RUNS: the broker, tansu, cannot take them. Its SQLite fetch
#                    reads every record from the fetch offset to the end of the partition (a window sum
#                    over the whole backlog, then one header query per record returned:
#                    tansu-storage 0.6.0 src/sql/record_fetch.sql), so a consumer slows as its backlog
#                    grows: a plain consumer with no delayd (confluent-kafka) read a backlog of 2,000 at
#                    3,158/s and one of 20,000 at 644/s; at 1,000 requests/s the backlog grows and never
#                    drains, and at 2,000/s tansu answers produce requests with UNKNOWN_SERVER_ERROR.
#                    Every Kafka run: tansu (`cargo install tansu --version 0.6.0 --locked --features
#                    libsql`; port 9498, SQLite store); requests produced to topic delayd-in (4
#                    partitions; idempotent, acks=all, a batch's delivery reports awaited), ingested
#                    once delayd counts them durable; read from topic loadgen-out. Before sending,
#                    loadgen waits until delayd's consumer and its own reader have joined their groups
#                    (tansu takes seconds to answer a join);
#   redis-publish, nats-publish, amqp-publish, kafka-publish
#                    the MQ's own ceiling: the same requests published the same way to an MQ with no
#                    delayd, counted once the MQ confirmed them (XADD answered, PubAck, confirm,
#                    delivery report).
#   MQ-straight, MQ-pass (MQ = redis, nats, amqp, kafka)
#                    N_PASS (20,000) messages due at once, in batches of 100 from 8 producers: a
#                    straight pass publishes them to the target and reads them there (the MQ's own
#                    pass, no delayd); a sidecar pass publishes them to delayd's source and reads them
#                    from the target. `pass_s` is the first request to the last message read; the
#                    script ends with one `MQ-ratio` line per MQ: sidecar pass / straight pass (the goal:
#                    at most 2). kafka-straight-headers: the straight Kafka pass with the two headers a
#                    request carries (tansu stores headers at ten times the cost of the records).
# Redis is durable (appendonly yes, appendfsync always). Bodies are BODY_BYTES (1 KiB) and due 1-10 s
# after sending. Prints one JSON line per run.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-100000}
N_PASS=${N_PASS:-20000}
RUNS=${RUNS:-http-batch redis-publish sidecar sidecar-10k nats-publish nats nats-10k amqp-publish amqp amqp-10k amqp-5k kafka-publish kafka-500 redis-straight redis-pass nats-straight nats-pass amqp-straight amqp-pass kafka-straight kafka-pass kafka-straight-headers}
BODY_BYTES=${BODY_BYTES:-1024}
RABBIT=/usr/lib/rabbitmq/bin/rabbitmq-server
# RabbitMQ's AMQP, Erlang distribution and epmd ports (below the ephemeral range, so the tests' free
# ports never take them).
AMQP_PORT=5698 DIST_PORT=25698 EPMD_PORT=14398
missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v nats-server >/dev/null || missing+=(nats-server)
[ -x "$RABBIT" ] || missing+=(rabbitmq-server)
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if [[ " $RUNS " == *" kafka"* ]] && ! command -v tansu >/dev/null; then
  echo "tansu is not installed: cargo install tansu --version 0.6.0 --locked --features libsql" >&2
  exit 1
fi
WORK=$(mktemp -d /var/tmp/delayd-sidecar.XXXXXX)
chmod 755 "$WORK"

stop_delayd() {
  [ -n "${DELAYD_PID:-}" ] && { kill "$DELAYD_PID" 2>/dev/null || true; wait "$DELAYD_PID" 2>/dev/null || true; }
  DELAYD_PID=
}
stop_mq() {
  redis-cli -p 6398 shutdown nosave >/dev/null 2>&1 || true
  [ -n "${TANSU_PID:-}" ] && { kill "$TANSU_PID" 2>/dev/null || true; wait "$TANSU_PID" 2>/dev/null || true; }
  TANSU_PID=
  [ -n "${NATS_PID:-}" ] && { kill "$NATS_PID" 2>/dev/null || true; wait "$NATS_PID" 2>/dev/null || true; }
  NATS_PID=
  if [ -n "${RABBIT_PID:-}" ]; then
    # Its process group: the script, the Erlang VM and its helpers (setsid made it a group leader).
    kill -TERM -- "-$RABBIT_PID" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 -- "-$RABBIT_PID" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$RABBIT_PID" 2>/dev/null || true
    wait "$RABBIT_PID" 2>/dev/null || true
    RABBIT_PID=
    # Its own epmd (refuses while it still lists the node, until it sees the VM's socket close).
    for _ in $(seq 50); do ERL_EPMD_PORT=$EPMD_PORT epmd -kill >/dev/null 2>&1 && break; sleep 0.1; done
  fi
}
cleanup() {
  stop_delayd
  stop_mq
  wait 2>/dev/null || true
  # KEEP_WORK=1 leaves the last run's files (delayd.out holds its log: RUST_LOG=delayd::source=trace
  # shows each batch's timing).
  if [ -n "${KEEP_WORK:-}" ]; then echo "kept $WORK" >&2; else rm -rf "$WORK"; fi
}
trap cleanup EXIT

. benches/build.sh

# config KIND URL SINK_KEYS SOURCE_KEYS: $WORK/KIND.toml, a KIND source `in` on the MQ at URL feeding a
# KIND sink `out` there, each with its own keys (lines) beside the ones they share.
config() {
  cat >"$WORK/$1.toml" <<TOML
[sinks.out]
kind = "$1"
url = "$2"
max_in_flight = 8
$3

[sources.in]
kind = "$1"
url = "$2"
$4
sink = "out"
batch = 1024
TOML
}
config redis "redis://127.0.0.1:6398/" "" $'stream_key = "delayd:in"\nconsumer = "bench"'
config nats "nats://127.0.0.1:4298" "" $'stream = "DELAYS"\nsubject = "delayd.>"'
config kafka "kafka://127.0.0.1:9498" "" $'topics = ["delayd-in"]\nconsumer = "bench"'
config amqp "amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f" 'exchange = ""' 'queue = "delayd.in"'

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start_rabbit() {
  local dir=$WORK/rabbitmq
  mkdir -p "$dir" && : >"$dir/enabled_plugins" && chown -R rabbitmq:rabbitmq "$dir"
  # None of the machine's own configuration; a node name, files and ports of its own.
  setsid runuser -u rabbitmq -- env HOME="$dir" \
    RABBITMQ_NODE_IP_ADDRESS=127.0.0.1 RABBITMQ_NODE_PORT=$AMQP_PORT RABBITMQ_DIST_PORT=$DIST_PORT \
    ERL_EPMD_PORT=$EPMD_PORT RABBITMQ_NODENAME=delayd-bench@localhost \
    RABBITMQ_MNESIA_BASE="$dir/mnesia" RABBITMQ_LOG_BASE="$dir/log" \
    RABBITMQ_ENABLED_PLUGINS_FILE="$dir/enabled_plugins" RABBITMQ_CONFIG_FILE="$dir/rabbitmq" \
    RABBITMQ_ADVANCED_CONFIG_FILE="$dir/advanced.config" RABBITMQ_CONF_ENV_FILE="$dir/rabbitmq-env.conf" \
    "$RABBIT" </dev/null >"$WORK/rabbitmq.out" 2>&1 &
  RABBIT_PID=$!
  for _ in $(seq 900); do port_open "$AMQP_PORT" && return; sleep 0.1; done
  echo "RabbitMQ did not start in 90 s: see $WORK/rabbitmq.out" >&2
  exit 1
}

# start MQ [alone]: a fresh MQ server (redis, nats or amqp) and, unless alone, a fresh delayd with that
# MQ's source and sink.
start() {
  stop_delayd
  stop_mq
  rm -rf "$WORK/delayd" "$WORK/redis" "$WORK/nats" "$WORK/rabbitmq" "$WORK/kafka"
  case $1 in
    redis)
      mkdir -p "$WORK/redis"
      redis-server --port 6398 --dir "$WORK/redis" --appendonly yes --appendfsync always --save '' \
        --daemonize yes --logfile "$WORK/redis.log"
      for _ in $(seq 50); do redis-cli -p 6398 ping >/dev/null 2>&1 && break; sleep 0.1; done
      ;;
    nats)
      nats-server -js -p 4298 -sd "$WORK/nats" >"$WORK/nats.log" 2>&1 &
      NATS_PID=$!
      for _ in $(seq 100); do port_open 4298 && break; sleep 0.1; done
      ;;
    amqp) start_rabbit ;;
    kafka)
      mkdir -p "$WORK/kafka"
      (cd "$WORK/kafka" && exec tansu broker --listener-url tcp://127.0.0.1:9498 \
        --advertised-listener-url tcp://127.0.0.1:9498 --storage-engine sqlite://tansu.db) \
        >"$WORK/tansu.log" 2>&1 &
      TANSU_PID=$!
      for _ in $(seq 100); do port_open 9498 && break; sleep 0.1; done
      ;;
  esac
  [ "${2:-}" = alone ] && return
  target/release/delayd serve --data-dir "$WORK/delayd" --listen 127.0.0.1:7398 --config "$WORK/$1.toml" \
    >"$WORK/delayd.out" 2>"$WORK/delayd.log" &
  DELAYD_PID=$!
  for _ in $(seq 100); do grep -q "delayd ready" "$WORK/delayd.out" && break; sleep 0.1; done
}
common=(--url http://127.0.0.1:7398 --redis-url redis://127.0.0.1:6398/ --nats-url nats://127.0.0.1:4298
  --amqp-url "amqp://guest:guest@127.0.0.1:$AMQP_PORT/%2f" --kafka-brokers 127.0.0.1:9498
  --body-bytes "$BODY_BYTES")
spread=(--delay-min-ms 1000 --delay-max-ms 10000)
fast=(--mode batch --batch 1000 --concurrency 8 --messages "$N" "${spread[@]}")
paced=(--mode batch --batch 100 --concurrency 8 --messages 100000 --rate 10000 "${spread[@]}")
# The passes: N_PASS messages due at once, published as fast as the MQ takes them; a straight pass
# publishes them to the target itself (no delayd) and reads them there.
pass=(--mode batch --batch 100 --concurrency 8 --messages "$N_PASS" --delay-min-ms 0 --delay-max-ms 1
  --grace-ms 300000)
RESULTS=$WORK/results.jsonl
run() { # run LABEL MQ TARGET WORKLOAD...: one run, when RUNS names it
  local label=$1 mq=$2 target=$3 alone=
  shift 3
  [[ " $RUNS " == *" $label "* ]] || return 0
  [[ " $* " == *" --publish-only "* || " $* " == *" --straight "* ]] && alone=alone
  start "$mq" $alone
  "$LOADGEN" --target "$target" "$@" "${common[@]}" --label "$label" | tee -a "$RESULTS"
}
run http-batch redis delayd "${fast[@]}"
run redis-publish redis delayd-redis "${fast[@]}" --publish-only
run sidecar redis delayd-redis "${fast[@]}"
run sidecar-10k redis delayd-redis "${paced[@]}"
run nats-publish nats delayd-nats "${fast[@]}" --publish-only
run nats nats delayd-nats "${fast[@]}"
run nats-10k nats delayd-nats "${paced[@]}"
run amqp-publish amqp delayd-amqp "${fast[@]}" --publish-only
run amqp amqp delayd-amqp "${fast[@]}"
run amqp-10k amqp delayd-amqp "${paced[@]}"
run amqp-5k amqp delayd-amqp --mode batch --batch 100 --concurrency 8 --messages 50000 --rate 5000
run kafka-publish kafka delayd-kafka "${fast[@]}" --publish-only
run kafka-500 kafka delayd-kafka --mode batch --batch 50 --concurrency 8 --messages 5000 --rate 500
run kafka kafka delayd-kafka "${fast[@]}"
for mq in redis nats amqp kafka; do
  run "$mq-straight" "$mq" "delayd-$mq" "${pass[@]}" --straight
  run "$mq-pass" "$mq" "delayd-$mq" "${pass[@]}"
done
run kafka-straight-headers kafka delayd-kafka "${pass[@]}" --straight --with-headers
# One line per MQ whose two passes ran: the sidecar's pass time over the MQ's own (the goal: at most 2).
python3 - "$RESULTS" <<'PY'
import json, sys
runs = {}
for line in open(sys.argv[1]):
    if line.strip():
        one = json.loads(line)
        runs[one["label"]] = one
for mq in ["redis", "nats", "amqp", "kafka"]:
    straight, sidecar = runs.get(f"{mq}-straight"), runs.get(f"{mq}-pass")
    if straight and sidecar and straight.get("pass_s") and sidecar.get("pass_s"):
        print(json.dumps({"label": f"{mq}-ratio", "messages": sidecar["messages"],
                          "straight_s": straight["pass_s"], "sidecar_s": sidecar["pass_s"],
                          "ratio": round(sidecar["pass_s"] / straight["pass_s"], 2)}))
    elif straight and sidecar:
        print(json.dumps({"label": f"{mq}-ratio", "messages": sidecar["messages"],
                          "straight_s": straight.get("pass_s"), "sidecar_s": None,
                          "lost": sidecar.get("lost"), "ratio": None}))
PY
run kafka-10k kafka delayd-kafka "${paced[@]}"
