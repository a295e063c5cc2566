# SPDX-License-Identifier: Apache-2.0
"""End-to-end KV reuse on a real GPU through the kvplane Python package
(libkvplane's kernels and its block store; no ctypes, no struct mirrors).

A small randomly initialised decoder (pre-norm, GQA attention, SiLU MLP; no
downloaded weights) prefills a prompt into a paged KV cache laid out as vLLM's
flash-attention NHD (per layer K and V: [num_blocks, block_size, kv_heads,
head_dim], bf16), described to kvplane as a KvLayout on a Device("cuda").
The prompt's blocks then take three ways back into the cache, each time into
*different* block ids after the cache was poisoned with NaN, and generation
continues from each:
  1. the kernels alone: KvLayout.gather into host memory registered with
     Device.host_register (all layers, one launch), KvLayout.scatter back;
  2. kvtier from DRAM: TierLink.save (gathers straight into reserved slots of
     the TierStore's DRAM tier, keyed by the prompt's chained block keys;
     the store is made with device=: its region is registered with the
     device), TierLink.load (scatters straight out of the DRAM slots);
  3. kvtier from NVMe: the DRAM blocks written back to slab files
     (TierStore.idle + TierStore.sync, O_DIRECT), the store closed and
     re-created from its files (DRAM empty), TierLink.load reads every block
     from disk and scatters it.
The stores are configured through the YAML `tiers:` section
(TierStore.from_config).
Checks, for each way:
  * restored KV bytes == saved KV bytes (bitwise), the poisoned rest untouched
  * decode logits from the restored cache == decode logits from the original
    cache (bitwise: same bytes, same kernels)
  * kvtier: every block stored / loaded from the expected tier; the link's
    stats: blocks_saved_direct, blocks_direct (in place from DRAM, none from
    NVMe), blocks_saved, blocks_loaded, blocks_missed; write-back wrote them all
and once: decode logits vs a full recompute (prefill of prompt + generated
tokens, no cache): max |diff| / max |logit| <= 5e-2 (bf16; different attention
kernels).  Prints restore vs recompute (prefill) times for 4K, 16K, 64K tokens.

  python3 tests/e2e/reuse_e2e.py [LIBKVPLANE] [--tokens 4096,16384,65536]
      [--nvme-dir DIR]   (default: the first of /var/tmp, /tmp, . that takes O_DIRECT)
LIBKVPLANE (optional; what CTest passes: build/libkvplane.so) is not loaded:
the package carries its own libkvplane.  It only locates a build's package
when `import kvplane` fails: the venv CTest's test_python makes beside it
(DIR_OF_LIBKVPLANE/py/venv).  Otherwise install the package (pip install
./connectors/python, or the wheel of bench/micro/gpu_prep.sh).
Exit 0 pass, 1 fail (kvplane not importable included), 77 skip (no PyTorch,
no CUDA device, kvplane's CUDA backend unavailable).
"""
import argparse
import glob
import importlib.util
import os
import sys
import time

from e2e_util import pick_nvme_dir

# Deterministic cuBLAS (must precede CUDA's initialisation): the restored and
# the original continuation must be comparable bit for bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
TOL = 5e-2  # decode vs full-recompute logits: max |diff| / max |logit|, bf16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("lib", nargs="?", default=None,
                    help="libkvplane.so of a build (not loaded; locates BUILD/py/venv)")
    ap.add_argument("--tokens", default="4096,16384,65536")
    ap.add_argument("--nvme-dir", default=None, help="directory for kvtier's slab files (O_DIRECT)")
    return ap.parse_args(argv)


def skip(why):
    print(f"SKIP: {why}", flush=True)
    sys.exit(77)


def build_site_packages(lib):
    """site-packages of the venv test_python makes in the build directory
    of `lib` (BUILD/py/venv), for this Python's version; None if absent."""
    if not lib:
        return None
    v = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    d = os.path.join(os.path.dirname(os.path.abspath(lib)), "py", "venv", "lib", v, "site-packages")
    return d if os.path.isdir(os.path.join(d, "kvplane")) else None


def import_kvplane(lib):
    """(kvplane module or None, the error)."""
    if importlib.util.find_spec("kvplane") is None:
        site = build_site_packages(lib)
        if site:
            sys.path.append(site)
    try:
        import kvplane
        return kvplane, None
    except ImportError as e:
        return None, e


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None and importlib.util.find_spec("torch") is None:
    skip("PyTorch not installed")  # fast: nothing loaded
kvplane, KVPLANE_ERROR = import_kvplane(ARGS.lib if ARGS else None)
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    skip("PyTorch not installed")


class Model(torch.nn.Module):
    """Pre-norm decoder; attention through a paged cache or over the whole
    sequence (the recompute)."""

    def __init__(self, vocab, d, layers, heads, kv_heads, head_dim):
        super().__init__()
        self.h, self.kvh, self.hd = heads, kv_heads, head_dim
        self.emb = torch.nn.Embedding(vocab, d)
        self.layers = torch.nn.ModuleList()
        for _ in range(layers):
            m = torch.nn.ModuleDict(dict(
                n1=torch.nn.RMSNorm(d), qkv=torch.nn.Linear(d, (heads + 2 * kv_heads) * head_dim, bias=False),
                o=torch.nn.Linear(heads * head_dim, d, bias=False), n2=torch.nn.RMSNorm(d),
                up=torch.nn.Linear(d, 4 * d, bias=False), down=torch.nn.Linear(4 * d, d, bias=False)))
            self.layers.append(m)
        self.norm = torch.nn.RMSNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def rope(self, x, pos):  # x [T, H, D]
        d = x.shape[-1]
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
        ang = pos[:, None].float() * inv[None]
        cos, sin = ang.cos()[:, None, :].to(x.dtype), ang.sin()[:, None, :].to(x.dtype)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), -1).flatten(-2)

    def qkv(self, m, x, pos):
        T = x.shape[0]
        qkv = m["qkv"](m["n1"](x)).view(T, self.h + 2 * self.kvh, self.hd)
        q, k, v = qkv.split([self.h, self.kvh, self.kvh], 1)
        return self.rope(q, pos), self.rope(k, pos), v

    def attend(self, q, k, v, causal):  # q [T,H,D], k/v [S,KVH,D]
        rep = self.h // self.kvh
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        if not causal:  # decode: plain matmuls, deterministic
            s = torch.einsum("thd,shd->hts", q.float(), k.float()) / self.hd ** 0.5
            o = torch.einsum("hts,shd->thd", torch.softmax(s, -1), v.float()).to(q.dtype)
            return o.reshape(q.shape[0], -1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], is_causal=causal)
        return o[0].transpose(0, 1).reshape(q.shape[0], -1)

    @torch.no_grad()
    def prefill(self, tokens, cache=None, table=None, bs=16):
        """Whole sequence at once; writes K/V into the paged cache if given.
        Returns logits of every position."""
        x = self.emb(tokens)
        pos = torch.arange(tokens.shape[0], device=tokens.device)
        for li, m in enumerate(self.layers):
            q, k, v = self.qkv(m, x, pos)
            if cache is not None:
                T = tokens.shape[0]
                kc, vc = cache[li]
                nb = T // bs
                kc[table[:nb]] = k[:nb * bs].view(nb, bs, self.kvh, self.hd)
                vc[table[:nb]] = v[:nb * bs].view(nb, bs, self.kvh, self.hd)
            x = x + m["o"](self.attend(q, k, v, True))
            x = x + m["down"](F.silu(m["up"](m["n2"](x))))
        return self.head(self.norm(x))

    @torch.no_grad()
    def decode(self, token, p, cache, table, bs=16):
        """One token at position p; K/V of positions < p come from the cache
        through the block table, its own K/V is written into it."""
        x = self.emb(token.view(1))
        pos = torch.tensor([p], device=token.device)
        for li, m in enumerate(self.layers):
            q, k, v = self.qkv(m, x, pos)
            kc, vc = cache[li]
            kc[table[p // bs], p % bs] = k[0]
            vc[table[p // bs], p % bs] = v[0]
            nblk = p // bs + 1
            K = kc[table[:nblk]].reshape(-1, self.kvh, self.hd)[:p + 1]
            V = vc[table[:nblk]].reshape(-1, self.kvh, self.hd)[:p + 1]
            x = x + m["o"](self.attend(q, K, V, False))
            x = x + m["down"](F.silu(m["up"](m["n2"](x))))
        return self.head(self.norm(x))[0]


def cuda_time(fn):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def continue_from(model, cache, table, n_tokens, first, ref_logits, what):
    """Decodes len(ref_logits) tokens from the cache through `table`; every
    step's logits must equal ref_logits bit for bit."""
    nxt = first
    for i, ref in enumerate(ref_logits):
        lg = model.decode(torch.tensor(nxt, device="cuda"), n_tokens + i, cache, table)
        assert torch.equal(lg, ref), f"{what}: decode step {i} differs from the original cache"
        nxt = int(lg.argmax())


def check_restored(cache, table, saved, nprompt, poisoned, what):
    """Blocks table[:nprompt] hold the saved bytes; blocks `poisoned` are
    still NaN (nothing else was written)."""
    for li, (kc, vc) in enumerate(cache):
        assert torch.equal(kc[table[:nprompt]].view(torch.int16), saved[li][0].view(torch.int16)), f"{what}: K bytes"
        assert torch.equal(vc[table[:nprompt]].view(torch.int16), saved[li][1].view(torch.int16)), f"{what}: V bytes"
        assert torch.isnan(kc[poisoned]).all() and torch.isnan(vc[poisoned]).all(), f"{what}: stray writes"


def poison(cache):
    for kc, vc in cache:
        kc.fill_(float("nan")), vc.fill_(float("nan"))
    torch.cuda.synchronize()


def tier_yaml(block_bytes, nblocks, nvme_dir):
    """The store's YAML `tiers:` section: DRAM for every block plus room,
    NVMe 1.5 times that, 32 I/Os in flight."""
    return (f"tiers:\n  dram_bytes: {nblocks * block_bytes + (64 << 20)}\n  nvme_dir: {nvme_dir}\n"
            f"  nvme_bytes: {nblocks * block_bytes * 3 // 2 + (256 << 20)}\n  queue_depth: 32\n")


class Tier:
    """A kvtier store with DRAM and NVMe tiers, its DRAM registered with the
    device, linked to the engine's layout, configured through the YAML
    `tiers:` section."""

    def __init__(self, dev, lay, ns, block_bytes, nblocks, nvme_dir):
        self.dir = nvme_dir
        self.t = kvplane.TierStore.from_config(tier_yaml(block_bytes, nblocks, nvme_dir), device=dev)
        self.t.add_namespace(ns, block_bytes=block_bytes)  # fixed DRAM slots
        self.l = kvplane.TierLink(self.t, dev, lay, ns)

    def close(self):
        self.l.close()
        self.t.close()

    def stats(self):
        return self.l.stats()


def prompt_keys(ns, tokens, nprompt):
    """The prompt's chained block keys (XXH3-128 over the namespace seed)."""
    keys = kvplane.Hasher(ns).hash(tokens)
    assert len(keys) == nprompt, f"{len(keys)} keys for {nprompt} blocks"
    return keys


def wall_ms(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, r


def run_tier(dev, lay, stream, model, cache, snap, tokens, tables, saved_a, ref_logits, first,
             cfg, nvme_dir):
    """Ways 2 and 3: the prompt's blocks through kvtier's DRAM, then NVMe.
    Returns (save ms, DRAM load ms, NVMe write-back ms, NVMe load ms)."""
    bs = 16
    table_a, table_b = tables
    n_tokens = len(tokens)
    nprompt = n_tokens // bs
    block_bytes = cfg["layers"] * 2 * bs * cfg["kv_heads"] * cfg["head_dim"] * 2
    assert lay.block_bytes == block_bytes, f"layout block_bytes {lay.block_bytes} != {block_bytes}"
    ns = kvplane.Namespace("kvplane-e2e/random-decoder", bs, tokenizer_id="random",
                           kv_layout=f"vllm-nhd:bf16:l{cfg['layers']}:h{cfg['kv_heads']}x{cfg['head_dim']}")
    keys = prompt_keys(ns, tokens, nprompt)
    for f in glob.glob(os.path.join(nvme_dir, "kvtier-*.slab")):
        os.unlink(f)  # a fresh store
    for li, (kc, vc) in enumerate(cache):  # the cache as prefill left it
        kc.copy_(snap[li][0]), vc.copy_(snap[li][1])

    try:
        return run_tier_ways(dev, lay, stream, model, cache, tokens, table_a, table_b, saved_a,
                             ref_logits, first, ns, keys, block_bytes, nvme_dir)
    finally:
        for f in glob.glob(os.path.join(nvme_dir, "kvtier-*.slab")):
            os.unlink(f)


def write_back(store):
    """Idle write-back of every DRAM block, then fdatasync: blocks written."""
    written = 0
    while True:  # each idle window writes up to 256 blocks
        w = store.idle(2**64 - 1)
        if w == 0:
            break
        written += w
    store.sync()
    return written


def run_tier_dram(tier, stream, model, cache, n_tokens, table_a, table_b, saved_a, ref_logits,
                  first, keys, ids_a, ids_b):
    """Way 2 (save, three loads into poisoned blocks B), then the write-back.
    Returns (save ms, DRAM load ms, write-back ms)."""
    nprompt = len(keys)
    t_save, res = wall_ms(lambda: tier.l.save(keys, ids_a, cls="stable", stream=stream))
    n = sum(r == 1 for r in res)
    assert n == nprompt and res == [1] * nprompt, f"TierLink.save stored {n} of {nprompt}: {res}"
    saved_direct = tier.stats().blocks_saved_direct  # gathered into the DRAM slots
    assert saved_direct == nprompt, f"{saved_direct} of {nprompt} saved in place"
    loads = []
    for _ in range(3):  # the third is timed; each into poisoned blocks
        poison(cache)
        t, res = wall_ms(lambda: tier.l.load(keys, ids_b, stream=stream))
        n = sum(r is not None for r in res)
        assert n == nprompt and all(r == kvplane.Tier.DRAM for r in res), f"DRAM load: {n} of {nprompt}"
        loads.append(t)
    check_restored(cache, table_b, saved_a, nprompt, table_a, "kvtier DRAM")
    continue_from(model, cache, table_b, n_tokens, first, ref_logits, "kvtier DRAM")
    t0 = time.perf_counter()
    written = write_back(tier.t)
    t_wb = (time.perf_counter() - t0) * 1e3
    assert written == nprompt, f"write-back wrote {written} of {nprompt} blocks"
    st = tier.stats()
    assert st.blocks_saved == nprompt and st.blocks_loaded == 3 * nprompt and st.blocks_missed == 0, st
    # 1 MiB blocks in fixed slots of a registered region: scattered in place
    assert st.blocks_direct == 3 * nprompt, f"{st.blocks_direct} of {3 * nprompt} loaded in place"
    return t_save, loads[-1], t_wb


def run_tier_ways(dev, lay, stream, model, cache, tokens, table_a, table_b, saved_a, ref_logits,
                  first, ns, keys, block_bytes, nvme_dir):
    n_tokens, nprompt = len(tokens), len(keys)
    ids_a, ids_b = table_a[:nprompt].tolist(), table_b[:nprompt].tolist()
    tier = Tier(dev, lay, ns, block_bytes, nprompt, nvme_dir)
    try:
        t_save, t_dram, t_wb = run_tier_dram(tier, stream, model, cache, n_tokens, table_a, table_b,
                                             saved_a, ref_logits, first, keys, ids_a, ids_b)
    finally:
        tier.close()

    # the worker restarts: DRAM is gone, the slab files are what is left
    tier = Tier(dev, lay, ns, block_bytes, nprompt, nvme_dir)
    try:
        poison(cache)
        t_nvme, res = wall_ms(lambda: tier.l.load(keys, ids_b, stream=stream))
        n = sum(r is not None for r in res)
        assert n == nprompt and all(r == kvplane.Tier.NVME for r in res), f"NVMe load: {n} of {nprompt}"
        assert tier.stats().blocks_direct == 0  # read from disk into the staging buffer
        check_restored(cache, table_b, saved_a, nprompt, table_a, "kvtier NVMe")
        continue_from(model, cache, table_b, n_tokens, first, ref_logits, "kvtier NVMe")
    finally:
        tier.close()
    return t_save, t_dram, t_wb, t_nvme


def reference(model, cache, table_a, tokens, logits_prefill, n_tokens, gen):
    """The continuation from the original cache (blocks A), twice: the
    second run shows the decode itself is deterministic on this stack.
    Returns (snapshot of the cache after prefill, ref logits, all tokens)."""
    snap = [(k.clone(), v.clone()) for k, v in cache]
    ref_logits, toks = [], tokens.tolist()
    nxt = int(logits_prefill[-1].argmax())
    for i in range(gen):
        lg = model.decode(torch.tensor(nxt, device="cuda"), n_tokens + i, cache, table_a)
        ref_logits.append(lg)
        toks.append(nxt)
        nxt = int(lg.argmax())
    for li, (kc, vc) in enumerate(cache):
        kc.copy_(snap[li][0]), vc.copy_(snap[li][1])
    nxt = int(logits_prefill[-1].argmax())
    for i in range(gen):
        lg = model.decode(torch.tensor(nxt, device="cuda"), n_tokens + i, cache, table_a)
        assert torch.equal(lg, ref_logits[i]), f"decode not deterministic here (step {i})"
        nxt = int(lg.argmax())
    return snap, ref_logits, toks


def recompute_check(model, tokens, toks, ref_logits, n_tokens, gen):
    """Full recompute: prefill prompt + generated tokens, no cache.  Returns
    (prefill ms of the prompt, worst max |diff| / max |logit|)."""
    full = torch.tensor(toks, device="cuda")
    t_recompute = [cuda_time(lambda: model.prefill(tokens)) for _ in range(3)][-1]
    rec = model.prefill(full)
    worst = 0.0
    for i in range(gen):
        a, b = ref_logits[i].float(), rec[n_tokens + i].float()  # same input position
        worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    assert worst <= TOL, f"recompute differs: {worst}"
    return t_recompute, worst


def run(dev, model, n_tokens, cfg, nvme_dir, gen=8):
    bs, L, kvh, hd = 16, cfg["layers"], cfg["kv_heads"], cfg["head_dim"]
    assert n_tokens % bs == 0
    nprompt = n_tokens // bs
    nblocks = 2 * (nprompt + gen // bs + 2) + 8
    g = torch.Generator(device="cuda").manual_seed(n_tokens)
    cache = [(torch.empty(nblocks, bs, kvh, hd, device="cuda", dtype=torch.bfloat16),
              torch.empty(nblocks, bs, kvh, hd, device="cuda", dtype=torch.bfloat16)) for _ in range(L)]
    for kc, vc in cache:
        kc.fill_(float("nan")), vc.fill_(float("nan"))
    perm = torch.randperm(nblocks, generator=g, device="cuda")
    table_a, table_b = perm[:nblocks // 2].contiguous(), perm[nblocks // 2:].contiguous()
    tokens = torch.randint(0, cfg["vocab"], (n_tokens,), device="cuda", generator=g)

    # the kvplane layout over the engine's tensors, transfers on torch's stream
    lay = kvplane.KvLayout(dev, [c[0] for c in cache], [c[1] for c in cache], kind="vllm_nhd")
    stream = dev.stream(torch.cuda.current_stream().cuda_stream)

    # prefill into blocks A
    logits_prefill = model.prefill(tokens, cache, table_a)
    torch.cuda.synchronize()

    # save: gather blocks A -> DRAM (registered host memory), one launch
    block_bytes = L * 2 * bs * kvh * hd * 2
    assert lay.block_bytes == block_bytes, f"layout block_bytes {lay.block_bytes} != {block_bytes}"
    host = torch.empty(nprompt * block_bytes, dtype=torch.uint8)  # pageable, then pinned by kvplane
    dev.host_register(host)
    ids_a, ids_b = table_a[:nprompt].tolist(), table_b[:nprompt].tolist()
    t_save = cuda_time(lambda: lay.gather(ids_a, host, stream=stream, sync=False))

    snap, ref_logits, toks = reference(model, cache, table_a, tokens, logits_prefill, n_tokens, gen)
    saved_a = [(k[table_a[:nprompt]].clone(), v[table_a[:nprompt]].clone()) for k, v in snap]

    # drop everything from the GPU, restore into other block ids B
    for kc, vc in cache:
        kc.fill_(float("nan")), vc.fill_(float("nan"))
    t_restore = [cuda_time(lambda: lay.scatter(ids_b, host, stream=stream, sync=False))
                 for _ in range(3)][-1]
    check_restored(cache, table_b, saved_a, nprompt, table_a, "kernels")
    first = int(logits_prefill[-1].argmax())
    continue_from(model, cache, table_b, n_tokens, first, ref_logits, "kernels")

    # the same blocks through kvtier: DRAM, then NVMe after a restart
    tt = run_tier(dev, lay, stream, model, cache, snap, tokens.tolist(), (table_a, table_b),
                  saved_a, ref_logits, first, cfg, nvme_dir)

    t_recompute, worst = recompute_check(model, tokens, toks, ref_logits, n_tokens, gen)
    kv_mib = nprompt * block_bytes / 2**20
    print(f"| {n_tokens:>6} | {kv_mib:8.1f} | {t_save:8.2f} | {t_restore:8.2f} | {tt[0]:8.1f} | {tt[1]:8.1f} | "
          f"{tt[2]:8.0f} | {tt[3]:8.0f} | {t_recompute:9.2f} | {t_recompute / t_restore:6.1f}x / "
          f"{t_recompute / tt[1]:.1f}x / {t_recompute / tt[3]:.2f}x | {worst:.2e} |", flush=True)
    dev.synchronize()
    stream.close()
    dev.host_unregister(host)
    lay.close()


def print_header(dev, cfg, nvme_dir):
    print(f"device: {dev.name}; model: {cfg}, bf16, random weights; "
          f"KV layout vllm_nhd, 16-token blocks; kvtier NVMe directory {nvme_dir}; times in ms: kernels "
          f"alone and recompute by CUDA events (3rd of 3 runs), kvtier calls by the wall clock "
          f"(synchronous; DRAM load 3rd of 3, NVMe load once: a second would hit DRAM after promotion)")
    print(f"kvplane {kvplane.__version__} ({os.path.dirname(kvplane.__file__)}), torch {torch.__version__}")
    print("| tokens | KV MiB | save (gather D2H) | restore (scatter H2D) | kvtier save (to DRAM) | "
          "kvtier load from DRAM | write-back to NVMe (idle + fdatasync) | kvtier load from NVMe "
          "(after restart) | recompute (prefill) | recompute / restore: kernels / kvtier DRAM / kvtier NVMe | "
          "decode logits vs recompute, max rel |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")


def main(a):
    if not torch.cuda.is_available():
        skip("no CUDA: torch.cuda.is_available() is False")
    if kvplane is None:
        print(f"FAIL: import kvplane: {KVPLANE_ERROR} (install the package; see the docstring)")
        return 1
    ok, why = kvplane.backend_available("cuda")
    if not ok:
        skip(f"no CUDA: {why}")
    with kvplane.Device("cuda") as dev:
        torch.manual_seed(0)
        cfg = dict(vocab=4096, d=2048, layers=16, heads=16, kv_heads=8, head_dim=128)
        model = Model(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"])
        model = model.to("cuda", torch.bfloat16).eval()
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        nvme_dir = pick_nvme_dir(a.nvme_dir, "kvp-e2e")
        print_header(dev, cfg, nvme_dir)
        try:
            for n in [int(t) for t in a.tokens.split(",")]:
                run(dev, model, n, cfg, nvme_dir)
        finally:
            os.rmdir(nvme_dir)  # each run removes its slab files
    print("each way (kernels alone, kvtier DRAM, kvtier NVMe after a restart): restored KV bitwise "
          "equal to the saved KV, the rest of the cache untouched, and decode logits from the restored "
          "cache bitwise equal to those from the original cache at every step")
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
