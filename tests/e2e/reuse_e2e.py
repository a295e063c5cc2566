# SPDX-License-Identifier: Apache-2.0
"""End-to-end KV reuse on a real GPU through libkvplane's kernels and its
block store.

A small randomly initialised decoder (pre-norm, GQA attention, SiLU MLP; no
downloaded weights) prefills a prompt into a paged KV cache laid out as vLLM's
flash-attention NHD (per layer K and V: [num_blocks, block_size, kv_heads,
head_dim], bf16).  The prompt's blocks then take three ways back into the
cache, each time into *different* block ids after the cache was poisoned with
NaN, and generation continues from each:
  1. the kernels alone: kvp_device_gather into registered host memory (all
     layers, one launch), kvp_device_scatter back;
  2. kvtier from DRAM: kvp_tier_save (gathers straight into reserved slots of
     the store's DRAM tier, keyed by the prompt's chained block keys),
     kvp_tier_load (scatters
     straight out of the DRAM slots: the region is registered with the
     device);
  3. kvtier from NVMe: the DRAM blocks written back to slab files
     (kvp_tier_idle + kvp_tier_sync, O_DIRECT), the store destroyed and
     re-created from its files (DRAM empty), kvp_tier_load reads every block
     from disk and scatters it.
Checks, for each way:
  * restored KV bytes == saved KV bytes (bitwise), the poisoned rest untouched
  * decode logits from the restored cache == decode logits from the original
    cache (bitwise: same bytes, same kernels)
and once: decode logits vs a full recompute (prefill of prompt + generated
tokens, no cache): max |diff| / max |logit| <= 5e-2 (bf16; different attention
kernels).  Prints restore vs recompute (prefill) times for 4K, 16K, 64K tokens.

  python3 tests/e2e/reuse_e2e.py path/to/libkvplane.so [--tokens 4096,16384,65536]
      [--nvme-dir DIR]   (default: the first of /var/tmp, /tmp, . that takes O_DIRECT)
Exit 0 pass, 1 fail, 77 skip (no CUDA / torch).
"""
import argparse
import ctypes as C
import glob
import os
import sys
import time

# Deterministic cuBLAS (must precede CUDA's initialisation): the restored and
# the original continuation must be comparable bit for bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIP: PyTorch not installed")
    sys.exit(77)


def load_kvplane(path):
    """ctypes.CDLL(path), once more in a fresh process if the dynamic loader
    is out of static TLS: Debian's libjemalloc (a dependency of libkvplane)
    uses initial-exec TLS, and loaded after PyTorch's libraries there may be
    no room left for it (dlopen: "cannot allocate memory in static TLS
    block").  Preloading it reserves the room at start-up."""
    try:
        return C.CDLL(path)
    except OSError as e:
        if "static TLS" not in str(e) or os.environ.get("KVP_E2E_REEXEC"):
            raise
        import subprocess
        ldd = subprocess.run(["ldd", path], capture_output=True, text=True).stdout
        jem = [ln.split("=>")[1].split("(")[0].strip() for ln in ldd.splitlines()
               if "libjemalloc" in ln and "=>" in ln]
        if not jem or not os.path.exists(jem[0]):
            raise
        print(f"note: {e}; running again with LD_PRELOAD={jem[0]}", flush=True)
        env = dict(os.environ, KVP_E2E_REEXEC="1",
                   LD_PRELOAD=(jem[0] + " " + os.environ.get("LD_PRELOAD", "")).strip())
        os.execve(sys.executable, [sys.executable] + sys.argv, env)


class DeviceOpts(C.Structure):
    _fields_ = [("backend", C.c_int), ("ordinal", C.c_int32), ("cta_budget", C.c_uint32),
                ("flags", C.c_uint32), ("reserved", C.c_uint32 * 8)]


class LayoutDesc(C.Structure):
    _fields_ = [("kind", C.c_int), ("num_layers", C.c_uint32), ("num_blocks", C.c_uint32),
                ("block_size", C.c_uint32), ("num_kv_heads", C.c_uint32), ("head_dim", C.c_uint32),
                ("elem_size", C.c_uint32), ("reserved0", C.c_uint32),
                ("k_layers", C.POINTER(C.c_void_p)), ("v_layers", C.POINTER(C.c_void_p)),
                ("base", C.c_void_p), ("reserved", C.c_uint64 * 6)]


class Xfer(C.Structure):
    _fields_ = [("layout", C.c_void_p), ("block_ids", C.POINTER(C.c_uint32)), ("n", C.c_uint32),
                ("method", C.c_uint32), ("staging", C.c_void_p), ("staging_bytes", C.c_uint64),
                ("staging_slots", C.POINTER(C.c_uint32)), ("flags", C.c_uint32),
                ("reserved32", C.c_uint32), ("reserved", C.c_uint64 * 3)]


class NsDesc(C.Structure):
    _fields_ = [("model_id", C.c_char_p), ("tokenizer_id", C.c_char_p), ("kv_layout", C.c_char_p),
                ("block_size", C.c_uint32), ("tenant_salt", C.c_char_p)]


class Key(C.Structure):
    _fields_ = [("hi", C.c_uint64), ("lo", C.c_uint64)]


class Namespace(C.Structure):
    _fields_ = [("seed", Key), ("block_size", C.c_uint32), ("reserved_", C.c_uint32)]


class TierNsOpts(C.Structure):
    _fields_ = [("block_bytes", C.c_uint64), ("aes256_key", C.c_void_p),
                ("prefill_kv_bytes_per_s", C.c_double), ("reserved", C.c_uint32 * 6)]


class PutOpts(C.Structure):
    _fields_ = [("cls", C.c_int), ("flags", C.c_uint32), ("reserved", C.c_uint32 * 6)]


class LinkOpts(C.Structure):
    _fields_ = [("staging_blocks", C.c_uint32), ("reserved", C.c_uint32 * 7)]


class LinkStats(C.Structure):
    _fields_ = [("saves", C.c_uint64), ("loads", C.c_uint64), ("blocks_saved", C.c_uint64),
                ("blocks_save_failed", C.c_uint64), ("blocks_loaded", C.c_uint64),
                ("blocks_missed", C.c_uint64), ("wrong_length", C.c_uint64),
                ("gathers", C.c_uint64), ("scatters", C.c_uint64), ("blocks_direct", C.c_uint64),
                ("blocks_saved_direct", C.c_uint64), ("reserved", C.c_uint64 * 5)]


assert C.sizeof(DeviceOpts) == 48 and C.sizeof(LayoutDesc) == 104 and C.sizeof(Xfer) == 80
assert C.sizeof(NsDesc) == 40 and C.sizeof(Namespace) == 24 and C.sizeof(TierNsOpts) == 48
assert C.sizeof(PutOpts) == 32 and C.sizeof(LinkOpts) == 32 and C.sizeof(LinkStats) == 128
TIER_OPTS_BYTES = 4096  # kvp_tier_opts is filled by the library (from YAML): room to spare
KVP_TIER_DRAM, KVP_TIER_NVME, KVP_CLASS_STABLE = 1, 2, 2

KVP_BACKEND_CUDA, KVP_LAYOUT_VLLM_NHD = 1, 1
TOL = 5e-2  # decode vs full-recompute logits: max |diff| / max |logit|, bf16


class Kvp:
    def __init__(self, path):
        L = self.lib = load_kvplane(path)
        L.kvp_strerror.restype = C.c_char_p
        L.kvp_backend_available.argtypes = [C.c_int, C.c_char_p, C.c_size_t]
        for f in ("kvp_device_create", "kvp_kv_layout_create", "kvp_device_gather",
                  "kvp_device_scatter", "kvp_device_host_register", "kvp_stream_wrap",
                  "kvp_stream_synchronize", "kvp_device_synchronize"):
            getattr(L, f).restype = C.c_int
        L.kvp_device_gather.argtypes = [C.c_void_p, C.c_void_p, C.POINTER(Xfer)]
        L.kvp_device_scatter.argtypes = [C.c_void_p, C.c_void_p, C.POINTER(Xfer)]
        L.kvp_device_host_register.argtypes = [C.c_void_p, C.c_void_p, C.c_size_t]
        L.kvp_kv_layout_create.argtypes = [C.c_void_p, C.POINTER(LayoutDesc), C.POINTER(C.c_void_p)]
        L.kvp_stream_wrap.argtypes = [C.c_void_p, C.c_void_p, C.POINTER(C.c_void_p)]
        L.kvp_stream_synchronize.argtypes = [C.c_void_p]
        L.kvp_device_name.restype = C.c_char_p
        L.kvp_device_name.argtypes = [C.c_void_p]
        vp, i = C.c_void_p, C.c_int
        sig = {  # the block store (include/kvplane/tier.h) and the keys (prefix.h)
            "kvp_config_load_mem": (i, [C.c_char_p, C.c_size_t, C.c_char_p, vp, C.POINTER(vp), C.c_char_p, C.c_size_t]),
            "kvp_config_destroy": (None, [vp]),
            "kvp_tier_opts_from_config": (i, [vp, vp, C.c_char_p, C.c_size_t, C.c_char_p, C.c_size_t]),
            "kvp_tier_opts_set_device": (i, [vp, vp]),
            "kvp_tier_create": (i, [vp, vp, C.POINTER(vp)]),
            "kvp_tier_destroy": (None, [vp]),
            "kvp_tier_ns_add": (i, [vp, C.POINTER(Namespace), C.POINTER(TierNsOpts)]),
            "kvp_tier_link_create": (i, [vp, vp, vp, C.POINTER(Namespace), C.POINTER(LinkOpts), vp, C.POINTER(vp)]),
            "kvp_tier_link_destroy": (None, [vp]),
            "kvp_tier_link_stats_get": (i, [vp, C.POINTER(LinkStats)]),
            "kvp_tier_save": (i, [vp, vp, C.POINTER(Key), C.POINTER(C.c_uint32), C.c_size_t,
                                  C.POINTER(PutOpts), C.POINTER(C.c_int)]),
            "kvp_tier_load": (i, [vp, vp, C.POINTER(Key), C.POINTER(C.c_uint32), C.c_size_t, C.POINTER(C.c_int)]),
            "kvp_tier_idle": (i, [vp, C.c_uint64]),
            "kvp_tier_sync": (i, [vp]),
            "kvp_namespace_init": (i, [C.POINTER(NsDesc), C.POINTER(Namespace)]),
            "kvp_hasher_create": (i, [C.POINTER(Namespace), vp, vp, C.POINTER(vp)]),
            "kvp_hasher_destroy": (None, [vp]),
            "kvp_hasher_hash": (i, [vp, C.POINTER(C.c_uint32), C.c_size_t, vp, C.POINTER(Key), C.c_size_t, vp]),
        }
        for f, (res, args) in sig.items():
            getattr(L, f).restype, getattr(L, f).argtypes = res, args

    def check(self, rc, what):
        if rc < 0:
            raise RuntimeError(f"{what}: {self.lib.kvp_strerror(rc).decode()} ({rc})")
        return rc


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


def pick_nvme_dir(asked):
    """A new directory for the slab files, inside the first directory whose
    file system takes O_DIRECT (kvtier's slab files need it; tmpfs does not)."""
    for d in ([asked] if asked else ["/var/tmp", "/tmp", "."]):
        probe = os.path.join(d, f".kvp-odirect-{os.getpid()}")
        try:
            fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        except OSError:
            continue
        os.close(fd)
        os.unlink(probe)
        sub = os.path.join(os.path.abspath(d), f"kvp-e2e-{os.getpid()}")
        os.makedirs(sub)
        return sub
    raise RuntimeError(f"no directory here takes O_DIRECT (tried {asked or '/var/tmp, /tmp, .'})")


class Tier:
    """A kvtier store with DRAM and NVMe tiers, linked to the device and the
    engine's layout, configured through the YAML `tiers:` section."""

    def __init__(self, kvp, dev, lay, ns, block_bytes, nblocks, nvme_dir):
        self.kvp, L = kvp, kvp.lib
        self.dir = nvme_dir
        yaml = (f"tiers:\n  dram_bytes: {nblocks * block_bytes + (64 << 20)}\n  nvme_dir: {nvme_dir}\n"
                f"  nvme_bytes: {nblocks * block_bytes * 3 // 2 + (256 << 20)}\n  queue_depth: 32\n").encode()
        err = C.create_string_buffer(512)
        cfg = C.c_void_p()
        kvp.check(L.kvp_config_load_mem(yaml, len(yaml), b"reuse_e2e", None, C.byref(cfg), err, 512),
                  f"config: {err.value.decode()}")
        self.opts = C.create_string_buffer(TIER_OPTS_BYTES)  # zero = defaults
        self.dirbuf = C.create_string_buffer(4096)
        try:
            kvp.check(L.kvp_tier_opts_from_config(cfg, self.opts, self.dirbuf, 4096, err, 512),
                      f"tiers: {err.value.decode()}")
        finally:
            L.kvp_config_destroy(cfg)
        kvp.check(L.kvp_tier_opts_set_device(self.opts, dev), "kvp_tier_opts_set_device")
        self.t, self.l = C.c_void_p(), C.c_void_p()
        kvp.check(L.kvp_tier_create(self.opts, None, C.byref(self.t)), "kvp_tier_create")
        kvp.check(L.kvp_tier_ns_add(self.t, C.byref(ns), C.byref(TierNsOpts(block_bytes=block_bytes))),
                  "kvp_tier_ns_add")
        kvp.check(L.kvp_tier_link_create(self.t, dev, lay, C.byref(ns), C.byref(LinkOpts()), None,
                                         C.byref(self.l)), "kvp_tier_link_create")

    def close(self):
        self.kvp.lib.kvp_tier_link_destroy(self.l)
        self.kvp.lib.kvp_tier_destroy(self.t)

    def stats(self):
        st = LinkStats()
        self.kvp.check(self.kvp.lib.kvp_tier_link_stats_get(self.l, C.byref(st)), "link stats")
        return st


def prompt_keys(kvp, ns, tokens, nprompt):
    """The prompt's chained block keys (XXH3-128 over the namespace seed)."""
    h = C.c_void_p()
    kvp.check(kvp.lib.kvp_hasher_create(C.byref(ns), None, None, C.byref(h)), "hasher")
    toks = (C.c_uint32 * len(tokens))(*tokens)
    keys = (Key * nprompt)()
    try:
        assert kvp.lib.kvp_hasher_hash(h, toks, len(tokens), None, keys, nprompt, None) == nprompt
    finally:
        kvp.lib.kvp_hasher_destroy(h)
    return keys


def wall_ms(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    r = fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3, r


def run_tier(kvp, dev, lay, stream, model, cache, snap, tokens, tables, saved_a, ref_logits, first,
             cfg, nvme_dir):
    """Ways 2 and 3: the prompt's blocks through kvtier's DRAM, then NVMe.
    Returns (save ms, DRAM load ms, NVMe write-back ms, NVMe load ms)."""
    L, bs = kvp.lib, 16
    table_a, table_b = tables
    n_tokens = len(tokens)
    nprompt = n_tokens // bs
    block_bytes = cfg["layers"] * 2 * bs * cfg["kv_heads"] * cfg["head_dim"] * 2
    d = NsDesc(model_id=b"kvplane-e2e/random-decoder", tokenizer_id=b"random",
               kv_layout=f"vllm-nhd:bf16:l{cfg['layers']}:h{cfg['kv_heads']}x{cfg['head_dim']}".encode(),
               block_size=bs)
    ns = Namespace()
    kvp.check(L.kvp_namespace_init(C.byref(d), C.byref(ns)), "namespace")
    keys = prompt_keys(kvp, ns, tokens, nprompt)
    for f in glob.glob(os.path.join(nvme_dir, "kvtier-*.slab")):
        os.unlink(f)  # a fresh store
    for li, (kc, vc) in enumerate(cache):  # the cache as prefill left it
        kc.copy_(snap[li][0]), vc.copy_(snap[li][1])

    try:
        return run_tier_ways(kvp, dev, lay, stream, model, cache, tokens, table_a, table_b, saved_a,
                             ref_logits, first, ns, keys, block_bytes, nvme_dir)
    finally:
        for f in glob.glob(os.path.join(nvme_dir, "kvtier-*.slab")):
            os.unlink(f)


def run_tier_ways(kvp, dev, lay, stream, model, cache, tokens, table_a, table_b, saved_a, ref_logits,
                  first, ns, keys, block_bytes, nvme_dir):
    L, n_tokens, nprompt = kvp.lib, len(tokens), len(keys)
    ids_a = (C.c_uint32 * nprompt)(*table_a[:nprompt].tolist())
    ids_b = (C.c_uint32 * nprompt)(*table_b[:nprompt].tolist())
    res = (C.c_int * nprompt)()
    tier = Tier(kvp, dev, lay, ns, block_bytes, nprompt, nvme_dir)
    try:
        t_save, n = wall_ms(lambda: L.kvp_tier_save(tier.l, stream, keys, ids_a, nprompt,
                                                    C.byref(PutOpts(cls=KVP_CLASS_STABLE)), res))
        assert n == nprompt and all(r == 1 for r in res), f"kvp_tier_save stored {n} of {nprompt}"
        saved_direct = tier.stats().blocks_saved_direct  # gathered into the DRAM slots
        assert saved_direct == nprompt, f"{saved_direct} of {nprompt} saved in place"
        loads = []
        for _ in range(3):  # the third is timed; each into poisoned blocks
            poison(cache)
            t, n = wall_ms(lambda: L.kvp_tier_load(tier.l, stream, keys, ids_b, nprompt, res))
            assert n == nprompt and all(r == KVP_TIER_DRAM for r in res), f"DRAM load: {n} of {nprompt}"
            loads.append(t)
        check_restored(cache, table_b, saved_a, nprompt, table_a, "kvtier DRAM")
        continue_from(model, cache, table_b, n_tokens, first, ref_logits, "kvtier DRAM")
        t0 = time.perf_counter()
        written = 0
        while True:  # each idle window writes up to 256 blocks
            w = kvp.check(L.kvp_tier_idle(tier.t, 2**64 - 1), "kvp_tier_idle")
            if w == 0:
                break
            written += w
        kvp.check(L.kvp_tier_sync(tier.t), "kvp_tier_sync")
        t_wb = (time.perf_counter() - t0) * 1e3
        assert written == nprompt, f"write-back wrote {written} of {nprompt} blocks"
        st = tier.stats()
        assert st.blocks_saved == nprompt and st.blocks_loaded == 3 * nprompt and st.blocks_missed == 0
        # 1 MiB blocks in fixed slots of a registered region: scattered in place
        assert st.blocks_direct == 3 * nprompt, f"{st.blocks_direct} of {3 * nprompt} loaded in place"
    finally:
        tier.close()

    # the worker restarts: DRAM is gone, the slab files are what is left
    tier = Tier(kvp, dev, lay, ns, block_bytes, nprompt, nvme_dir)
    try:
        poison(cache)
        t_nvme, n = wall_ms(lambda: L.kvp_tier_load(tier.l, stream, keys, ids_b, nprompt, res))
        assert n == nprompt and all(r == KVP_TIER_NVME for r in res), f"NVMe load: {n} of {nprompt}"
        assert tier.stats().blocks_direct == 0  # read from disk into the staging buffer
        check_restored(cache, table_b, saved_a, nprompt, table_a, "kvtier NVMe")
        continue_from(model, cache, table_b, n_tokens, first, ref_logits, "kvtier NVMe")
    finally:
        tier.close()
    return t_save, loads[-1], t_wb, t_nvme


def run(kvp, dev, model, n_tokens, cfg, nvme_dir, gen=8):
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

    # the kvplane layout over the engine's tensors
    kp = (C.c_void_p * L)(*[c[0].data_ptr() for c in cache])
    vp = (C.c_void_p * L)(*[c[1].data_ptr() for c in cache])
    desc = LayoutDesc(kind=KVP_LAYOUT_VLLM_NHD, num_layers=L, num_blocks=nblocks, block_size=bs,
                      num_kv_heads=kvh, head_dim=hd, elem_size=2,
                      k_layers=C.cast(kp, C.POINTER(C.c_void_p)), v_layers=C.cast(vp, C.POINTER(C.c_void_p)))
    lay = C.c_void_p()
    kvp.check(kvp.lib.kvp_kv_layout_create(dev, C.byref(desc), C.byref(lay)), "layout")
    stream = C.c_void_p()
    kvp.check(kvp.lib.kvp_stream_wrap(dev, C.c_void_p(torch.cuda.current_stream().cuda_stream),
                                      C.byref(stream)), "stream")

    # prefill into blocks A
    logits_prefill = model.prefill(tokens, cache, table_a)
    torch.cuda.synchronize()

    # save: gather blocks A -> DRAM (registered host memory), one launch
    block_bytes = L * 2 * bs * kvh * hd * 2
    host = torch.empty(nprompt * block_bytes, dtype=torch.uint8)  # pageable, then pinned by kvplane
    kvp.check(kvp.lib.kvp_device_host_register(dev, C.c_void_p(host.data_ptr()), host.numel()), "register")
    ids_a = (C.c_uint32 * nprompt)(*table_a[:nprompt].tolist())
    ids_b = (C.c_uint32 * nprompt)(*table_b[:nprompt].tolist())
    xa = Xfer(layout=lay, block_ids=ids_a, n=nprompt, staging=host.data_ptr(), staging_bytes=host.numel())
    t_save = cuda_time(lambda: kvp.check(kvp.lib.kvp_device_gather(dev, stream, C.byref(xa)), "gather"))

    # reference continuation from the original cache (blocks A), twice: the
    # second run shows the decode itself is deterministic on this stack
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
    saved_a = [(k[table_a[:nprompt]].clone(), v[table_a[:nprompt]].clone()) for k, v in snap]

    # drop everything from the GPU, restore into other block ids B
    for kc, vc in cache:
        kc.fill_(float("nan")), vc.fill_(float("nan"))
    xb = Xfer(layout=lay, block_ids=ids_b, n=nprompt, staging=host.data_ptr(), staging_bytes=host.numel())
    t_restore = [cuda_time(lambda: kvp.check(kvp.lib.kvp_device_scatter(dev, stream, C.byref(xb)), "scatter"))
                 for _ in range(3)][-1]
    check_restored(cache, table_b, saved_a, nprompt, table_a, "kernels")
    first = int(logits_prefill[-1].argmax())
    continue_from(model, cache, table_b, n_tokens, first, ref_logits, "kernels")

    # the same blocks through kvtier: DRAM, then NVMe after a restart
    tt = run_tier(kvp, dev, lay, stream, model, cache, snap, tokens.tolist(), (table_a, table_b),
                  saved_a, ref_logits, first, cfg, nvme_dir)

    # full recompute: prefill prompt + generated tokens, no cache
    full = torch.tensor(toks, device="cuda")
    t_recompute = [cuda_time(lambda: model.prefill(tokens)) for _ in range(3)][-1]
    rec = model.prefill(full)
    worst = 0.0
    for i in range(gen):
        a, b = ref_logits[i].float(), rec[n_tokens + i].float()  # same input position
        worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    assert worst <= TOL, f"recompute differs: {worst}"
    kv_mib = nprompt * block_bytes / 2**20
    print(f"| {n_tokens:>6} | {kv_mib:8.1f} | {t_save:8.2f} | {t_restore:8.2f} | {tt[0]:8.1f} | {tt[1]:8.1f} | "
          f"{tt[2]:8.0f} | {tt[3]:8.0f} | {t_recompute:9.2f} | {t_recompute / t_restore:6.1f}x / "
          f"{t_recompute / tt[1]:.1f}x / {t_recompute / tt[3]:.2f}x | {worst:.2e} |", flush=True)
    kvp.lib.kvp_device_synchronize(dev)
    kvp.lib.kvp_stream_destroy(stream)
    kvp.lib.kvp_device_host_unregister(dev, C.c_void_p(host.data_ptr()))
    kvp.lib.kvp_kv_layout_destroy(lay)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("lib")
    ap.add_argument("--tokens", default="4096,16384,65536")
    ap.add_argument("--nvme-dir", default=None, help="directory for kvtier's slab files (O_DIRECT)")
    a = ap.parse_args()
    kvp = Kvp(a.lib)
    why = C.create_string_buffer(256)
    if not torch.cuda.is_available() or not kvp.lib.kvp_backend_available(KVP_BACKEND_CUDA, why, 256):
        print(f"SKIP: no CUDA: {why.value.decode()}")
        return 77
    kvp.lib.kvp_device_host_unregister.argtypes = [C.c_void_p, C.c_void_p]
    kvp.lib.kvp_stream_destroy.argtypes = [C.c_void_p]
    kvp.lib.kvp_kv_layout_destroy.argtypes = [C.c_void_p]
    kvp.lib.kvp_device_synchronize.argtypes = [C.c_void_p]
    dev = C.c_void_p()
    kvp.check(kvp.lib.kvp_device_create(C.byref(DeviceOpts(backend=KVP_BACKEND_CUDA)), None, C.byref(dev)), "device")
    torch.manual_seed(0)
    cfg = dict(vocab=4096, d=2048, layers=16, heads=16, kv_heads=8, head_dim=128)
    model = Model(cfg["vocab"], cfg["d"], cfg["layers"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"])
    model = model.to("cuda", torch.bfloat16).eval()
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    nvme_dir = pick_nvme_dir(a.nvme_dir)
    print(f"device: {kvp.lib.kvp_device_name(dev).decode()}; model: {cfg}, bf16, random weights; "
          f"KV layout vllm_nhd, 16-token blocks; kvtier NVMe directory {nvme_dir}; times in ms: kernels "
          f"alone and recompute by CUDA events (3rd of 3 runs), kvtier calls by the wall clock "
          f"(synchronous; DRAM load 3rd of 3, NVMe load once: a second would hit DRAM after promotion)")
    print("| tokens | KV MiB | save (gather D2H) | restore (scatter H2D) | kvtier save (to DRAM) | "
          "kvtier load from DRAM | write-back to NVMe (idle + fdatasync) | kvtier load from NVMe "
          "(after restart) | recompute (prefill) | recompute / restore: kernels / kvtier DRAM / kvtier NVMe | "
          "decode logits vs recompute, max rel |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    try:
        for n in [int(t) for t in a.tokens.split(",")]:
            run(kvp, dev, model, n, cfg, nvme_dir)
    finally:
        os.rmdir(nvme_dir)  # each run removes its slab files
    print("each way (kernels alone, kvtier DRAM, kvtier NVMe after a restart): restored KV bitwise "
          "equal to the saved KV, the rest of the cache untouched, and decode logits from the restored "
          "cache bitwise equal to those from the original cache at every step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
