#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""bench/live/scale_trace.py: the mapping of a trace onto a small real
engine's blocks (docs/live.md), and that kvplane-bench reads what it writes.

  test_scale_trace.py KVPLANE_BENCH SHARED_DIR WORK_DIR

Checks the mapping on hand-made traces (expected ids written out by hand,
not by the script's own arithmetic), the shared-prefix property on the
bundled Mooncake trace (two scaled prompts share engine block j exactly
when the originals share every trace block up to its end), the caps, the
refusals, and a `kvplane-bench run` of a scaled trace whose infinite-cache
hit rate equals the one computed here from the ids."""
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bench", "live"))
import scale_trace as st  # noqa: E402

B, SHARED, W = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(W, exist_ok=True)
fails = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        fails.append(what)


H = {"format": "kvplane-trace", "version": 1}
# 1. 512-token trace blocks at 1/16, 32-token engine blocks: one id each
_, out = st.scale(dict(H, block_size=512), [
    {"t": 0.5, "in": 5000, "out": 100, "hash_ids": [11, 12, 13, 14, 15, 16, 17, 18, 19]}],
    16, 32, 4096, 32)
check(out[0]["in"] == 313 and out[0]["hash_ids"] == [11, 12, 13, 14, 15, 16, 17, 18, 19]
      and out[0]["out"] == 7 and out[0]["t"] == 0.5,
      "512-token blocks at 1/16: ids kept one to one, in 5000 -> 313, out 100 -> 7: %s"
      % out[0])
# in 5000 / 16 = 312.5 -> 313 tokens = 9 full blocks; ids cover 9 * 512 = 4608
_, out = st.scale(dict(H, block_size=512), [
    {"t": 0, "in": 5000, "out": 1, "hash_ids": [1, 2, 3]}], 16, 32, 4096, 32)
check(out[0]["hash_ids"] == [1, 2, 3] and out[0]["in"] == 313,
      "only blocks wholly inside the keyed ids are keyed: %s" % out[0]["hash_ids"])
# 2. 64-token blocks at 1/32: an engine block = 16 trace blocks, the 16th's id
ids = list(range(100, 148))  # 48 blocks x 64 = 3072 trace tokens
_, out = st.scale(dict(H, block_size=64), [
    {"t": 0, "in": 3100, "out": 64, "session": "s1", "hash_ids": ids}], 32, 32, 4096, 32)
check(out[0]["hash_ids"] == [115, 131, 147] and out[0]["in"] == 97 and out[0]["out"] == 2
      and out[0]["session"] == "s1",
      "64-token blocks at 1/32: ids of trace blocks 15, 31, 47: %s" % out[0])
# 3. the cap on prompts
_, out = st.scale(dict(H, block_size=64), [
    {"t": 0, "in": 64 * 48 * 10, "out": 5, "hash_ids": ids}], 32, 32, 64, 32)
check(out[0]["in"] == 64 and out[0]["hash_ids"] == [115, 131],
      "--max-prompt 64 keeps the first 2 blocks: %s" % out[0])
# 4. a trace block wider than an engine block: sub-block ids, distinct
_, out = st.scale(dict(H, block_size=512), [
    {"t": 0, "in": 1024, "out": 1, "hash_ids": [7, 8]},
    {"t": 1, "in": 1024, "out": 1, "hash_ids": [7, 9]}], 8, 32, 4096, 32)
a, b = out[0]["hash_ids"], out[1]["hash_ids"]
check(len(a) == 4 and len(set(a)) == 4 and a[:2] == b[:2] and not set(a[2:]) & set(b[2:]),
      "512-token blocks at 1/8: two engine blocks a trace block, shared where the "
      "trace is: %s / %s" % (a, b))
# 5. refusals
try:
    st.scale(dict(H, block_size=64), [], 3, 32, 4096, 32)
    check(False, "block 32 x 1/3 = 96 trace tokens over 64-token blocks refused")
except ValueError as e:
    check("multiple" in str(e), "block 32 x 1/3 over 64-token blocks refused: %s" % e)
bad = os.path.join(W, "bad.jsonl")
with open(bad, "w") as f:
    f.write('{"timestamp": 1}\n')
p = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "bench", "live",
                                                 "scale_trace.py"), "--shrink", "16", bad,
                    os.path.join(W, "x.jsonl")], capture_output=True, text=True)
check(p.returncode != 0 and "not a kvplane-format trace" in p.stderr,
      "a trace not in kvplane format: a clear error (%r)" % p.stderr.strip())

# 6. the bundled Mooncake trace through convert + scale, read by run
raw, scaled = os.path.join(W, "mc.jsonl"), os.path.join(W, "mc.scaled.jsonl")
subprocess.run([B, "convert", "--limit", "300",
                os.path.join(SHARED, "traces", "mooncake_conversation.jsonl.zst"), raw],
               check=True, capture_output=True)
h, reqs = st.read(raw)
h2, out = st.scale(h, reqs, 16, 32, 4096, 32)
st.write(scaled, h2, out)
ok = True
for i in range(0, len(reqs) - 1, 7):   # pairs: shared prefixes keep their shape
    x, y = reqs[i], reqs[i + 1]
    common = 0
    while common < min(len(x["hash_ids"]), len(y["hash_ids"])) and \
            x["hash_ids"][common] == y["hash_ids"][common]:
        common += 1
    sx, sy = out[i]["hash_ids"], out[i + 1]["hash_ids"]
    sc = 0
    while sc < min(len(sx), len(sy)) and sx[sc] == sy[sc]:
        sc += 1
    if sc != min(common, len(sx), len(sy)):
        ok = False
check(ok, "Mooncake at 1/16: scaled prompts share exactly the blocks the originals share")
seen, hit, tot = set(), 0, 0
for r in out:
    n = 0
    while n < len(r["hash_ids"]) and r["hash_ids"][n] in seen:
        n += 1
    seen.update(r["hash_ids"])
    hit += n * 32
    tot += r["in"]
rdir = os.path.join(W, "run")
subprocess.run([B, "run", "--policies", "infinite", "--quiet", "--no-progress",
                "--out", rdir, scaled], check=True, capture_output=True)
with open(os.path.join(rdir, "results.json")) as f:
    run = json.load(f)["runs"][0]
got = run["policies"][0]["hit_rate"]
check(run["block_size"] == 32 and abs(got - hit / tot) < 1e-9,
      "kvplane-bench run reads the scaled trace: block 32, infinite-cache hit rate "
      "%.6f == %.6f computed from the ids" % (got, hit / tot))
sys.exit(1 if fails else 0)
