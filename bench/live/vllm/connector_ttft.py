#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""TTFT of a repeated long prompt on a REAL vLLM (CPU build, the tiny model),
with and without kvplane.vllm (kvtier as vLLM's KV connector); one engine at
a time, three starts:

  plain      no connector: cold prompts, then each again (vLLM's own
             prefix-cache hit)
  kvtier     the connector, kvtier empty: the same cold prompts (their
             blocks saved: DRAM + NVMe write-through), vLLM's prefix cache
             reset, each again (loaded from kvtier DRAM)
  restart    the same engine restarted: each again (loaded from kvtier's
             NVMe slab files, verified, through DRAM)

TTFT is the latency of a max_tokens=1 completion (prefill + one token),
median of --reps distinct prompts per size, after one warm-up request.

usage (the vLLM venv's python; kvplane built for it on PYTHONPATH, as
tests/interop/run_vllm_connector.sh builds it):
  connector_ttft.py --pkg DIR --work DIR [--sizes 4096,8192] [--reps 3]
"""
import argparse
import json
import os
import random
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, HERE)
import fleet as vf  # noqa: E402


class Engine(vf.Server):
    """vLLM as served (torch.compile on: prefill at its real speed)."""

    def __init__(self, a, tag, connector=None):
        super().__init__(a.work, "ttft-" + tag, a.model, 512 << 20, connector=connector,
                         pkg=a.pkg)
        self.ttft([1, 2, 3] * 40)  # warm-up

    def ttft(self, prompt):
        body = {"model": vf.MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                "temperature": 0}
        t0 = time.monotonic()
        r = vf.post(self.url + "/v1/completions", body)
        dt = time.monotonic() - t0
        det = (r.get("usage") or {}).get("prompt_tokens_details") or {}
        return dt, det.get("cached_tokens") or 0



def counters(stats_path):
    try:
        with open(stats_path) as f:
            st = json.load(f)
    except OSError:
        return {}
    return {k: st.get(k, 0) for k in ("save_ns", "load_ns", "lookup_ns")}


def run(eng, prompts, rows, label, stats_path, reset_first=False):
    """Per request: (TTFT s, cached tokens, connector ms spent saving,
    loading, looking up: deltas of its counters around the request)."""
    for size, ps in prompts.items():
        for p in ps:
            if reset_first:
                eng.reset_prefix_cache()
            c0 = counters(stats_path)
            dt, cached = eng.ttft(p)
            c1 = counters(stats_path)
            ms = [(c1.get(k, 0) - c0.get(k, 0)) / 1e6
                  for k in ("save_ns", "load_ns", "lookup_ns")]
            rows.setdefault((label, size), []).append((dt, cached, *ms))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--pkg", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, ".cache", "vllm-tiny"))
    ap.add_argument("--sizes", default="4096,8192")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    a.work, a.pkg = os.path.abspath(a.work), os.path.abspath(a.pkg)
    os.makedirs(a.work, exist_ok=True)
    nvme = os.path.join(a.work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    for n in os.listdir(nvme):
        os.unlink(os.path.join(nvme, n))
    cfg = os.path.join(a.work, "kvtier.yaml")
    with open(cfg, "w") as f:
        f.write(f"tiers:\n  dram_bytes: 1G\n  nvme_dir: {nvme}\n  nvme_bytes: 4G\n")
    stp = os.path.join(a.work, "stats.json")
    if os.path.exists(stp):
        os.unlink(stp)
    conn = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvplane.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"config": cfg,
                                          "stats_file": stp}}
    rng = random.Random(20261129)
    sizes = [int(s) for s in a.sizes.split(",")]
    prompts = {s: [[rng.randrange(1, vf.VOCAB) for _ in range(s)] for _ in range(a.reps)]
               for s in sizes}
    rows = {}
    e = Engine(a, "plain")
    try:
        run(e, prompts, rows, "cold, no connector", stp)
        run(e, prompts, rows, "vLLM prefix-cache hit", stp)
    finally:
        e.stop()
    e = Engine(a, "kvtier", conn)
    try:
        run(e, prompts, rows, "cold, connector saving", stp)
        run(e, prompts, rows, "kvtier DRAM load", stp, reset_first=True)
    finally:
        e.stop()
    e = Engine(a, "restart", conn)
    try:
        run(e, prompts, rows, "kvtier NVMe load after restart", stp)
    finally:
        e.stop()
    print("| case | prompt tokens | TTFT median (s) | min..max (s) | cached tokens "
          "| connector save / load / lookup, median (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for (label, size), v in rows.items():
        ts = [x[0] for x in v]
        med = [statistics.median(x[i] for x in v) for i in (2, 3, 4)]
        print(f"| {label} | {size} | {statistics.median(ts):.3f} | "
              f"{min(ts):.3f}..{max(ts):.3f} | {v[0][1]} | "
              f"{med[0]:.1f} / {med[1]:.1f} / {med[2]:.1f} |")
    with open(stp) as f:
        st = json.load(f)
    print("restart engine:", json.dumps({k: st[k] for k in (
        "blocks_saved", "blocks_loaded", "lookup_nvme_blocks", "lookup_dram_blocks",
        "verify_failed")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
