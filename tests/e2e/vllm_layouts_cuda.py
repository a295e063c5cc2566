# SPDX-License-Identifier: Apache-2.0
"""kvplane.vllm's GPU-only path, on the device machine (issue 39): the KV
cache layouts of vLLM's CUDA attention backends taken by
kvplane.vllm_kv_layout -- the function the connector's register_kv_caches
calls -- and moved by TierLink over Device("cuda"), as the connector's
wait_for_save (TierLink.save) and start_load_kv (TierLink.load) move them.
vLLM itself is not on the GPU machine; everything below the connector's
vLLM calls is.

Layouts, per layer, bf16, 16-token blocks:
  flash_attn  [2, NB, BS, H, D]  (K and V planes: kind vllm_nhd_kv)
  flashinfer  [NB, 2, BS, H, D]  (blocks first: each block one run)
For each: random KV in cache A; blocks saved from scattered ids of A into
kvtier (DRAM, written back to NVMe slab files); loaded into other ids of a
cache B poisoned with NaN, from DRAM, then after the store is closed and
re-opened from its files (a restart) from NVMe.  Checks: the loaded blocks
equal the saved ones bit for bit, every other block of B is still NaN, each
block came from the expected tier, and the two layouts key different
namespaces (a block saved under one is never loaded into the other).

  python3 tests/e2e/vllm_layouts_cuda.py [--nvme-dir DIR] [--backend cpu]
(--backend cpu: the same on host tensors and kvplane's CPU backend, a dry
run for a machine without a GPU.)
Exit 0 pass, 1 fail, 77 skip (no PyTorch, no CUDA device, kvplane's CUDA
backend unavailable).
"""
import argparse
import os
import shutil
import sys

from e2e_util import pick_nvme_dir

LAYERS, NB, BS, H, D = 4, 96, 16, 8, 128
SAVE_IDS = [3, 17, 40, 41, 77, 95]  # scattered blocks of cache A
LOAD_IDS = [90, 0, 12, 13, 50, 64]  # where they go in cache B


def skip(why):
    print(f"SKIP: {why}", flush=True)
    sys.exit(77)


try:
    import torch
except ImportError:
    skip("PyTorch not installed")
try:
    import kvplane
except ImportError as e:
    print(f"FAIL: kvplane is not importable: {e}")
    sys.exit(1)


def shape_of(kind):
    return (2, NB, BS, H, D) if kind == "flash_attn" else (NB, 2, BS, H, D)


def block(t, kind, b):
    """Block b of one layer's cache, as bytes (K then V)."""
    parts = [t[0, b], t[1, b]] if kind == "flash_attn" else [t[b]]
    return torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])


def store_yaml(block_bytes, nvme_dir):
    n = len(SAVE_IDS) * 2
    return (f"tiers:\n  dram_bytes: {n * block_bytes + (64 << 20)}\n  nvme_dir: {nvme_dir}\n"
            f"  nvme_bytes: {n * block_bytes * 2 + (256 << 20)}\n  queue_depth: 16\n")


def check_b(kind, a, b, tier_seen, want_tier, what):
    bad = []
    for r in tier_seen:
        if r != want_tier:
            bad.append(f"{what}: a block came from {r}, not {want_tier}")
    for la, lb in zip(a.values(), b.values()):
        for s, d in zip(SAVE_IDS, LOAD_IDS):
            if not torch.equal(block(la, kind, s), block(lb, kind, d)):
                bad.append(f"{what}: block {s} -> {d} differs")
        rest = [i for i in range(NB) if i not in LOAD_IDS]
        left = lb[:, rest] if kind == "flash_attn" else lb[rest]
        if not torch.isnan(left).all():
            bad.append(f"{what}: blocks not loaded were written")
    return bad


def run(kind, dev, nvme_dir, where):
    g = torch.Generator(device=where).manual_seed(39)
    a = {f"model.layers.{i}.self_attn": torch.randn(shape_of(kind), generator=g, device=where,
                                                     dtype=torch.bfloat16) for i in range(LAYERS)}
    b = {n: torch.full_like(t, float("nan")) for n, t in a.items()}
    lay_a, tag = kvplane.vllm_kv_layout(dev, a, NB, BS)
    lay_b, tag_b = kvplane.vllm_kv_layout(dev, b, NB, BS)
    want_kind = "vllm_nhd_kv" if kind == "flash_attn" else "mla"
    assert lay_a.kind == want_kind and tag == tag_b, (lay_a.kind, tag, tag_b)
    bb = lay_a.block_bytes
    assert bb == LAYERS * 2 * BS * H * D * 2, bb
    ns = kvplane.Namespace("kvplane-e2e/vllm-layouts", BS, kv_layout=f"vllm-{where}:bf16:{tag}")
    keys = kvplane.Hasher(ns).hash(list(range(1000, 1000 + BS * len(SAVE_IDS))))
    errors = []
    st = kvplane.TierStore.from_config(store_yaml(bb, nvme_dir), device=dev)
    try:
        st.add_namespace(ns, block_bytes=bb)
        with kvplane.TierLink(st, dev, lay_a, ns) as la, kvplane.TierLink(st, dev, lay_b, ns) as lb:
            res = la.save(keys, SAVE_IDS)
            assert res == [1] * len(SAVE_IDS), f"{kind}: save {res}"
            got = lb.load(keys, LOAD_IDS)
            dev.synchronize()
            errors += check_b(kind, a, b, got, kvplane.Tier.DRAM, f"{kind} from DRAM")
        written = 0
        while True:  # idle write-back of the DRAM blocks to the slab files
            w = st.idle(2**64 - 1)
            if w == 0:
                break
            written += w
        st.sync()
        assert written == len(SAVE_IDS), f"{kind}: wrote back {written} blocks"
    finally:
        st.close()
    for t in b.values():
        t.fill_(float("nan"))
    st = kvplane.TierStore.from_config(store_yaml(bb, nvme_dir), device=dev)  # a restart
    try:
        st.add_namespace(ns, block_bytes=bb)
        with kvplane.TierLink(st, dev, lay_b, ns) as lb:
            got = lb.load(keys, LOAD_IDS)
            dev.synchronize()
            errors += check_b(kind, a, b, got, kvplane.Tier.NVME, f"{kind} from NVMe")
    finally:
        st.close()
    lay_a.close()
    lay_b.close()
    print(f"{kind}: layout {want_kind}, tag {tag}, {bb} bytes a block, "
          f"{len(SAVE_IDS)} blocks via DRAM and NVMe: {'ok' if not errors else 'FAILED'}",
          flush=True)
    return errors, tag


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nvme-dir", default=None)
    ap.add_argument("--backend", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    if args.backend == "cuda" and not torch.cuda.is_available():
        skip("no CUDA device")
    ok, why = kvplane.backend_available(args.backend)
    if not ok:
        skip(f"kvplane's {args.backend} backend: {why}")
    nvme = pick_nvme_dir(args.nvme_dir, "kvp-layouts")
    errors, tags = [], []
    try:
        with kvplane.Device(args.backend) as dev:
            for kind in ("flash_attn", "flashinfer"):
                os.makedirs(os.path.join(nvme, kind))
                e, tag = run(kind, dev, os.path.join(nvme, kind), args.backend)
                errors += e
                tags.append(tag)
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    if tags[0] == tags[1]:
        errors.append(f"the two layouts share the namespace tag {tags[0]}")
    for e in errors:
        print("FAIL:", e)
    print("PASS" if not errors else f"FAIL: {len(errors)} check(s)")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
