#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A real peer router in front of kvplane's emulated vLLM workers: vllm-router
# 0.1.17 (PyPI, Rust) with its kv_aware policy consumes the workers' KV events
# (ZMQ PUB + replay, sha256_cbor int hashes, as vLLM 0.33 publishes them) and
# must route a trace with reuse to much higher hit rates than its own
# round_robin -- proof that the events are read, hashed and matched as vLLM's.
#   tests/interop/test_peer_routers.sh KVPLANE_BENCH [WORK_DIR]
# The router goes into a git-ignored venv (.venv-peers, pinned); exit 77 when
# PyPI cannot be reached and it is not installed yet.
set -u
B=${1:?usage: test_peer_routers.sh KVPLANE_BENCH [WORK_DIR]}
root=$(cd "$(dirname "$0")/../.." && pwd)
W=${2:-$(mktemp -d)}
V=$root/.venv-peers
MIN_GAIN=${MIN_GAIN:-8} # hit-rate points kv_aware must beat round_robin by
mkdir -p "$W"
if [ ! -x "$V/bin/vllm-router" ]; then
  python3 -m venv "$V" >/dev/null 2>&1 || { echo "SKIP: python3 -m venv failed"; exit 77; }
  "$V/bin/pip" install -q --disable-pip-version-check --timeout 20 --retries 1 \
    vllm-router==0.1.17 > "$W/pip.log" 2>&1 ||
    { echo "SKIP: could not install vllm-router 0.1.17 from PyPI"; tail -3 "$W/pip.log"; exit 77; }
fi
"$B" gen --seed 3 --sessions 12 --turns 6 "$W/trace.jsonl" > /dev/null || exit 1

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# run POLICY: a fresh 4-worker engine, the router, the trace; prints hit %
run() {
  local pol=$1 d=$W/$1 port prom ep rp
  mkdir -p "$d"
  "$B" engine --workers 4 --block-size 16 --time-scale 20 --max-model-len 1048576 \
    --ready-file "$d/eng.json" > "$d/engine.log" 2>&1 & ep=$!
  for _ in $(seq 100); do [ -s "$d/eng.json" ] && break; sleep 0.1; done
  local urls src=()
  urls=$(python3 -c "import json,sys; print(' '.join(w['url'] for w in json.load(open(sys.argv[1]))['workers']))" "$d/eng.json")
  if [ "$pol" = kv_aware ]; then
    mapfile -t src < <(python3 -c "
import json, sys
for w in json.load(open(sys.argv[1]))['workers']:
    print('--kv-event-source'); print(w['url'] + '=' + w['kv_events'])
    print('--kv-event-replay-source'); print(w['url'] + '=' + w['kv_replay'])" "$d/eng.json")
  fi
  port=$(free_port) prom=$(free_port)
  # shellcheck disable=SC2086
  "$V/bin/vllm-router" --host 127.0.0.1 --port "$port" --worker-urls $urls \
    --policy "$pol" "${src[@]}" --kv-event-block-size 16 --kv-event-model kvplane-emulated \
    --prometheus-port "$prom" --log-level warning > "$d/router.log" 2>&1 & rp=$!
  for _ in $(seq 200); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
  "$B" live --target "http://127.0.0.1:$port" --time-scale 20 --no-progress --out "$d/out" \
    "$W/trace.jsonl" > "$d/live.log" 2>&1
  kill "$rp" "$ep" 2>/dev/null; wait "$rp" "$ep" 2>/dev/null
  python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['runs'][0]['policies'][0]
assert r['requests'] > 0
print('%.2f' % (100 * r['hit_rate']))" "$d/out/results.json" 2>/dev/null || {
    echo "FAIL: $pol run produced no results" >&2; tail -5 "$d/live.log" "$d/router.log" >&2; echo nan; }
}

kv=$(run kv_aware) rr=$(run round_robin)
echo "vllm-router 0.1.17 over 4 emulated vLLM workers, generated agentic trace:"
echo "  kv_aware (consumes the workers' KV events): hit rate $kv %"
echo "  round_robin:                                hit rate $rr %"
python3 -c "
import sys
kv, rr, gain = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
ok = kv == kv and rr == rr and kv >= rr + gain
print('test_peer_routers: %s (kv_aware - round_robin = %.1f points, need >= %.0f)' % ('ok' if ok else 'FAIL', kv - rr, gain))
sys.exit(0 if ok else 1)" "$kv" "$rr" "$MIN_GAIN"
