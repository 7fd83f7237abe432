#!/usr/bin/env bash
# Checks the OpenAPI document against the live server: schemathesis (PyPI) reads GET /openapi.json and
# sends a bounded number of generated requests to every operation, valid and invalid ones, and fails on
# any 5xx and on any answer the document does not describe (status, content type, headers, body).
#
# Usage: tests/schemathesis.sh [path/to/delayd [schemathesis options...]]
# The binary defaults to target/debug/delayd (this script builds nothing); options after it are passed
# on to `schemathesis run` and win over the ones here (e.g. `--max-examples 500 --seed 7` to search
# harder).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${1:-target/debug/delayd}
[ -x "$BIN" ] || { echo "no delayd binary at $BIN (cargo build first)" >&2; exit 1; }
# .ci/run installs a pinned schemathesis and says where in $SCHEMATHESIS; otherwise the one on PATH.
SCHEMATHESIS=${SCHEMATHESIS:-schemathesis}
if ! command -v "$SCHEMATHESIS" >/dev/null; then
  echo "schemathesis is not installed (pip install schemathesis==4.32.5)" >&2
  exit 1
fi
# The server's config is the file below, whatever this shell's environment says.
while read -r name; do unset "$name"; done < <(compgen -e | grep '^DELAYD_' || true)

TOKEN=schemathesis-token-0123456789
WORK=$(mktemp -d)
SERVER=
cleanup() {
  local status=$?
  if [ "$status" != 0 ] && [ -f "$WORK/server.log" ]; then
    echo "failed ($status); the server's log:" >&2
    tail -n 50 "$WORK/server.log" >&2
  fi
  if [ -n "$SERVER" ]; then
    kill "$SERVER" 2>/dev/null || true
    # A graceful stop; killed after 10 s.
    for _ in $(seq 1 100); do kill -0 "$SERVER" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$SERVER" 2>/dev/null || true
    wait "$SERVER" 2>/dev/null || true
  fi
  rm -rf "$WORK"
}
trap cleanup EXIT
# Hypothesis keeps a directory of its own where it runs: in the work dir, not the repository.
export HYPOTHESIS_STORAGE_DIRECTORY=$WORK/hypothesis

# One bearer token, so that every /v1 operation is checked behind it (and `ignored_auth` checks that it
# is required). Long polls end within 200 ms: a generated wait_ms must not hold the run for 30 s. How full
# this machine's disk is must not decide the run. A webhook sink and a Redis source and sink whose
# servers are absent (tests/unreachable_connections.toml): dead letters to requeue and discard, and
# connections that say why they are down in /v1/sources and /v1/sinks.
cat >"$WORK/delayd.toml" <<EOF
data_dir = "$WORK/data"
listen = "127.0.0.1:0"
[auth]
tokens = ["$TOKEN"]
[broker]
max_wait = "200ms"
[limits]
min_free_disk_bytes = 0
EOF
cat tests/unreachable_connections.toml >>"$WORK/delayd.toml"
"$BIN" serve --config "$WORK/delayd.toml" >"$WORK/server.log" 2>&1 &
SERVER=$!

# Port 0 picks a free port; the server prints "delayd ready on URL" once recovery is done.
BASE=
for _ in $(seq 1 300); do
  BASE=$(sed -n 's/^delayd ready on \(http:[^ ]*\)$/\1/p' "$WORK/server.log")
  [ -n "$BASE" ] && break
  kill -0 "$SERVER" 2>/dev/null || break
  sleep 0.1
done
if [ -z "$BASE" ] ||
  [ "$(curl -s --max-time 10 -o /dev/null -w '%{http_code}' "$BASE/readyz")" != 200 ]; then
  echo "delayd did not become ready within 30 s" >&2 # (the trap shows its log)
  exit 1
fi

# Something for the generated requests to find, so that they reach past 404 to the answers with the
# most fields: a topic with a message whose body is text and one whose body is not UTF-8, a consumer
# group's offset in it, dead letters (to requeue, discard and look up, with their history) and a
# message due tomorrow. Schemathesis draws ids, topics and groups from these half of the time.
api() {
  curl -sf --max-time 10 -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' "$@"
}
# A JSON answer on stdin, and a Python expression `j` of it.
field() {
  python3 -c "import json, sys; j = json.load(sys.stdin); print($1)"
}
schedule() {
  api -d "$1" "$BASE/v1/messages" | field 'j["id"]'
}
IDS=(
  "$(schedule '{"topic": "seeded", "body": "text", "delay": 0, "key": "k1", "headers": {"h": "v"}}')"
  "$(schedule '{"topic": "seeded", "body_base64": "/w==", "delay": 0}')"
  "$(schedule '{"topic": "seeded", "body": "later", "delay": "1d"}')"
)
for n in 1 2 3 4; do
  IDS+=("$(schedule "{\"topic\": \"doomed\", \"body\": \"$n\", \"delay\": 0, \"sink\": \"unreachable\"}")")
done
QUEUE=
for _ in $(seq 1 100); do
  DEAD=$(api "$BASE/v1/messages?status=dead&topic=doomed" | field 'len(j["messages"])')
  QUEUE=$(api "$BASE/v1/topics/seeded" 2>/dev/null |
    field 'next((q["queue"] for q in j["queues"] if q["max_offset"] > 0), "")' || true)
  [ "$DEAD" = 4 ] && [ -n "$QUEUE" ] && break
  sleep 0.1
done
if [ "$DEAD" != 4 ] || [ -z "$QUEUE" ]; then
  echo "the seeded messages were not delivered and dead within 10 s" >&2
  exit 1
fi
api -o /dev/null -X PUT -d '{"offset": 1}' "$BASE/v1/groups/readers/offsets/seeded/$QUEUE"
quoted() { printf '"%s", ' "$@"; }
# No cache of earlier runs' failures in the work tree: each run is the same run.
cat >"$WORK/schemathesis.toml" <<EOF
[cache]
enabled = false
[dictionaries.ids]
values = [$(quoted "${IDS[@]}")]
[dictionaries.topics]
values = ["seeded", "doomed", "\$dead"]
[dictionaries.groups]
values = ["readers"]
[parameters]
"path.id" = { dictionary = "ids", probability = 0.5 }
"path.topic" = { dictionary = "topics", probability = 0.5 }
"path.group" = { dictionary = "groups", probability = 0.5 }
EOF

# Checked against a stricter copy of the document: an object that lists its properties gets
# `additionalProperties: false`, so that a field an answer has and the document lacks fails the run. (The
# document itself leaves answers open, so that a field added later breaks no client.)
curl -sf --max-time 10 "$BASE/openapi.json" | python3 -c '
import json, sys
def close(value):
    if isinstance(value, dict):
        if "properties" in value:
            value.setdefault("additionalProperties", False)
        for inner in value.values():
            close(inner)
    elif isinstance(value, list):
        for inner in value:
            close(inner)
document = json.load(sys.stdin)
close(document)
json.dump(document, sys.stdout)
' >"$WORK/openapi.json"
# Bounded: 25 examples per operation and phase, a fixed seed (the same requests each run), a timeout.
# Not checked: positive_data_acceptance (a valid-looking request can still be refused for what a schema
# cannot say: exactly one of deliver_at/delay/delay_level, max_delay from now, a limit from the
# config), negative_data_rejection (a batch answers 200 with a per-message problem for a malformed
# message, by design) and use_after_free (a cancelled message stays readable, with its status).
CHECKS=not_a_server_error,response_schema_conformance,status_code_conformance
CHECKS+=,content_type_conformance,response_headers_conformance,missing_required_header
CHECKS+=,ignored_auth,unsupported_method
# One worker: with two threads, hypothesis's ast.parse of its strategies' lambdas can race inside
# CPython 3.11 ("SystemError: AST constructor recursion depth mismatch"), failing a run at random.
status=0
timeout 300 "$SCHEMATHESIS" --config-file "$WORK/schemathesis.toml" run "$WORK/openapi.json" --url "$BASE" \
  --header "Authorization: Bearer $TOKEN" \
  --checks "$CHECKS" \
  --max-examples 25 \
  --seed 20261202 \
  --workers 1 \
  --request-timeout 10 \
  --generation-database none \
  --no-color \
  "${@:2}" || status=$?
exit "$status"
