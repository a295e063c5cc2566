#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Real peer routers in front of kvplane's emulated vLLM workers: vllm-router
# 0.1.17 (PyPI, Rust) with its kv_aware policy consumes the workers' KV events
# (ZMQ PUB + replay, sha256_cbor int hashes, as vLLM 0.33 publishes them) and
# must route a trace with reuse to much higher hit rates than its own
# round_robin -- proof that the events are read, hashed and matched as vLLM's.
# Then the two cache_aware policies that need no events: vllm-router's and
# sglang-router 0.3.2's (PyPI, Rust), both with text prompts (sglang-router's
# /v1/completions takes no token ids; the workers' tokenizer is byte-level,
# one ASCII byte a token): they must complete and beat round_robin.
#   tests/interop/test_peer_routers.sh KVPLANE_BENCH [WORK_DIR]
# The routers go into a git-ignored venv (.venv-peers, pinned); exit 77 when
# PyPI cannot be reached and they are not installed yet.
set -u
B=${1:?usage: test_peer_routers.sh KVPLANE_BENCH [WORK_DIR]}
root=$(cd "$(dirname "$0")/../.." && pwd)
W=${2:-$(mktemp -d)}
V=$root/.venv-peers
MIN_GAIN=${MIN_GAIN:-8} # hit-rate points kv_aware must beat round_robin by
mkdir -p "$W"
if [ ! -x "$V/bin/vllm-router" ] || [ ! -x "$V/bin/sglang-router" ]; then
  [ -x "$V/bin/pip" ] || python3 -m venv "$V" >/dev/null 2>&1 ||
    { echo "SKIP: python3 -m venv failed"; exit 77; }
  "$V/bin/pip" install -q --disable-pip-version-check --timeout 20 --retries 1 \
    vllm-router==0.1.17 sglang-router==0.3.2 > "$W/pip.log" 2>&1 ||
    { echo "SKIP: could not install vllm-router 0.1.17 / sglang-router 0.3.2 from PyPI"
      tail -3 "$W/pip.log"; exit 77; }
fi
"$B" gen --seed 3 --sessions 12 --turns 6 "$W/trace.jsonl" > /dev/null || exit 1

# a port below the ephemeral range (tests/interop/testports.py says why)
free_port() { PYTHONPATH="$root/tests/interop" python3 -c 'import testports; print(testports.free_port())'; }

# run NAME ROUTER POLICY [LIVE ARGS...]: a fresh 4-worker engine, ROUTER
# (vllm | sglang) with POLICY, the trace; prints the hit rate in %
run() {
  local name=$1 router=$2 pol=$3 d=$W/$1 port prom ep rp
  shift 3
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
  if [ "$router" = vllm ]; then
    # shellcheck disable=SC2086
    "$V/bin/vllm-router" --host 127.0.0.1 --port "$port" --worker-urls $urls \
      --policy "$pol" "${src[@]}" --kv-event-block-size 16 --kv-event-model kvplane-emulated \
      --prometheus-port "$prom" --log-level warning > "$d/router.log" 2>&1 & rp=$!
  else
    # shellcheck disable=SC2086
    "$V/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$port" \
      --worker-urls $urls --policy "$pol" --prometheus-port "$prom" \
      --prometheus-host 127.0.0.1 --log-level warn > "$d/router.log" 2>&1 & rp=$!
  fi
  for _ in $(seq 200); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
  "$B" live --target "http://127.0.0.1:$port" --time-scale 20 --no-progress --out "$d/out" \
    "$@" "$W/trace.jsonl" > "$d/live.log" 2>&1
  local alive=1
  kill -0 "$ep" 2>/dev/null || alive=0
  kill "$rp" "$ep" 2>/dev/null; wait "$rp" "$ep" 2>/dev/null
  if [ $alive = 0 ]; then # the engine is ours: nothing else may end it
    echo "FAIL: $name: the engine exited during the replay (killed from outside?)" >&2
    echo nan; return
  fi
  # every request answered (a router that fails requests measures nothing)
  python3 -c "
import json, sys
r = json.load(open(sys.argv[1]))['runs'][0]['policies'][0]
log = open(sys.argv[2]).read()
assert r['requests'] > 0 and ' ok, 0 errors,' in log
print('%.2f' % (100 * r['hit_rate']))" "$d/out/results.json" "$d/live.log" 2>/dev/null || {
    echo "FAIL: $name run failed requests or produced no results" >&2
    grep -E '^live:|request [0-9]+:' "$d/live.log" | head -4 >&2; tail -3 "$d/router.log" >&2; echo nan; }
}

# text prompts carry the model name: sglang-router requires the field
text=(--text-prompts --model kvplane-emulated)
kv=$(run kv_aware vllm kv_aware) rr=$(run round_robin vllm round_robin)
vca=$(run vllm_cache_aware vllm cache_aware "${text[@]}")
sca=$(run sglang_cache_aware sglang cache_aware "${text[@]}")
echo "4 emulated vLLM workers, generated agentic trace:"
echo "  vllm-router 0.1.17 kv_aware (consumes the workers' KV events): hit rate $kv %"
echo "  vllm-router 0.1.17 round_robin:                                hit rate $rr %"
echo "  vllm-router 0.1.17 cache_aware (text prompts):                 hit rate $vca %"
echo "  sglang-router 0.3.2 cache_aware (text prompts):                hit rate $sca %"
python3 -c "
import sys
kv, rr, vca, sca, gain = map(float, sys.argv[1:6])
ok = kv == kv and rr == rr and kv >= rr + gain
print('test_peer_routers: kv_aware %s (kv_aware - round_robin = %.1f points, need >= %.0f)'
      % ('ok' if ok else 'FAIL', kv - rr, gain))
for name, v in (('vllm-router cache_aware', vca), ('sglang-router cache_aware', sca)):
    good = v == v and rr == rr and v >= rr
    print('test_peer_routers: %s %s (%.1f points over round_robin, need >= 0)'
          % (name, 'ok' if good else 'FAIL', v - rr))
    ok = ok and good
sys.exit(0 if ok else 1)" "$kv" "$rr" "$vca" "$sca" "$MIN_GAIN"
