# SPDX-License-Identifier: Apache-2.0
"""KV reuse of a transformers Llama through the kvplane Python package on a
real GPU (issue 17): the package's Device / KvLayout / TierStore / TierLink
over the CUDA kernels.

A LlamaForCausalLM built from a small LlamaConfig with random weights (no
download) prefills a random prompt.  Its KV (past_key_values) is copied into
a vLLM flash-attention NHD paged cache (per layer K and V [num_blocks,
block_size, kv_heads, head_dim]) at some block ids, saved through TierLink
(kvp_tier_save: gathered straight into the TierStore's DRAM slots, keyed by
the prompt's chained block keys); the cache is poisoned with NaN, the blocks
are loaded back (kvp_tier_load) into OTHER block ids, past_key_values is
rebuilt from those blocks, and one decode step must give next-token logits
bit-identical to the same decode step over the original past_key_values.

  python3 tests/e2e/llama_reuse.py [--dtype bf16|fp32] [--blocks 24]
Exit 0 pass, 1 fail, 77 skip (no torch / CUDA / transformers).
bench/micro/gpu_run.sh runs it on the GPU machine (docs/bench.md#gpu-figures).
"""
import argparse
import os
import sys

# Deterministic cuBLAS (before CUDA initialises): both decode steps must be
# comparable bit for bit.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

try:
    import kvplane
    KVPLANE_ERROR = None
except ImportError as e:
    KVPLANE_ERROR = e


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(77)


def fail(why):
    print(f"FAIL: {why}")
    sys.exit(1)


try:
    import torch
except ImportError:
    skip("PyTorch not installed")
if not torch.cuda.is_available():
    skip("no CUDA device (torch.cuda.is_available() is False)")
try:
    import transformers
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError as e:
    skip(f"transformers not installed ({e})")
if KVPLANE_ERROR is not None:
    fail(f"import kvplane: {KVPLANE_ERROR}")

BS, KV_HEADS, LAYERS = 16, 4, 4


def model_of(dtype):
    cfg = LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024,
                      num_hidden_layers=LAYERS, num_attention_heads=8,
                      num_key_value_heads=KV_HEADS, max_position_embeddings=4096)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).to(device="cuda", dtype=dtype).eval()
    return m, cfg.hidden_size // cfg.num_attention_heads


def legacy(cache):
    """[(K, V)] per layer, each [1, kv_heads, tokens, head_dim].  transformers
    5.x keeps them in cache.layers[l].keys / .values; 4.x in key_cache /
    value_cache lists or a tuple of pairs."""
    if hasattr(cache, "layers"):
        return [(cache.layers[l].keys, cache.layers[l].values) for l in range(LAYERS)]
    if isinstance(cache, DynamicCache):
        return [(cache.key_cache[l], cache.value_cache[l]) for l in range(LAYERS)]
    return [(k, v) for k, v in cache]


def cache_of(kv):
    """A DynamicCache holding copies of kv (5.x: the constructor takes the
    pairs; 4.x: from_legacy_cache)."""
    pairs = tuple((k.clone(), v.clone()) for k, v in kv)
    if hasattr(DynamicCache, "from_legacy_cache"):
        return DynamicCache.from_legacy_cache(pairs)
    return DynamicCache(ddp_cache_data=pairs)


def decode(model, token, kv):
    cache = cache_of(kv)
    with torch.no_grad():
        return model(token, past_key_values=cache, use_cache=True).logits[:, -1]


def to_blocks(kv, K, V, ids, head_dim):
    """Prompt KV -> paged cache blocks ids (NHD: [block, pos, head, dim])."""
    for l, (k, v) in enumerate(kv):
        K[l][ids] = k[0].transpose(0, 1).reshape(len(ids), BS, KV_HEADS, head_dim)
        V[l][ids] = v[0].transpose(0, 1).reshape(len(ids), BS, KV_HEADS, head_dim)


def from_blocks(K, V, ids, head_dim):
    n = len(ids) * BS
    return [(K[l][ids].reshape(n, KV_HEADS, head_dim).transpose(0, 1).unsqueeze(0),
             V[l][ids].reshape(n, KV_HEADS, head_dim).transpose(0, 1).unsqueeze(0))
            for l in range(LAYERS)]


def bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def save_and_load(dev, K, V, tokens, save_ids, load_ids, dtype_name):
    ns = kvplane.Namespace("llama-random-4l", BS, kv_layout=f"vllm-nhd:{dtype_name}")
    keys = kvplane.Hasher(ns).hash(tokens)
    assert len(keys) == len(save_ids), (len(keys), len(save_ids))
    layout = kvplane.KvLayout(dev, K, V)
    store = kvplane.TierStore(dram_bytes=256 << 20, device=dev)
    store.add_namespace(ns, block_bytes=layout.block_bytes)
    link = kvplane.TierLink(store, dev, layout, ns)
    stream = dev.stream(torch.cuda.current_stream().cuda_stream)
    saved = link.save(keys, save_ids, stream=stream)
    if saved != [1] * len(save_ids):
        fail(f"TierLink.save results {saved}")
    snapshot = [(K[l][save_ids].clone(), V[l][save_ids].clone()) for l in range(LAYERS)]
    for t in K + V:
        t.fill_(float("nan"))
    torch.cuda.synchronize()
    got = link.load(keys, load_ids, stream=stream)
    torch.cuda.synchronize()
    if got != [kvplane.Tier.DRAM] * len(load_ids):
        fail(f"TierLink.load results {got}")
    st = link.stats()
    print(f"layout block_bytes {layout.block_bytes}; link {st}")
    print(f"device {dev.name}")
    link.close(), store.close(), layout.close()
    return snapshot


def check_restored(K, V, snapshot, load_ids):
    others = sorted(set(range(K[0].shape[0])) - set(load_ids))
    for l in range(LAYERS):
        if not (torch.equal(bits(K[l][load_ids]), bits(snapshot[l][0])) and
                torch.equal(bits(V[l][load_ids]), bits(snapshot[l][1]))):
            fail(f"layer {l}: restored blocks differ from the saved ones")
        if not (K[l][others].isnan().all() and V[l][others].isnan().all()):
            fail(f"layer {l}: a block outside the load targets was written")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--blocks", type=int, default=24, help="prompt blocks of 16 tokens")
    a = ap.parse_args()
    ok, why = kvplane.backend_available("cuda")
    if not ok:
        fail(f"kvplane's CUDA backend is not available: {why}")
    torch.use_deterministic_algorithms(True, warn_only=True)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    model, head_dim = model_of(dtype)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"kvplane {kvplane.__version__}, {torch.cuda.get_device_name()}, {a.dtype}")
    n = a.blocks
    g = torch.Generator(device="cpu").manual_seed(1)
    tokens = torch.randint(0, 1024, (n * BS,), generator=g)
    with torch.no_grad():
        out = model(tokens[None].cuda(), past_key_values=DynamicCache(), use_cache=True)
    kv = [(k.clone(), v.clone()) for k, v in legacy(out.past_key_values)]
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    ref = decode(model, nxt, kv)
    if not torch.equal(bits(decode(model, nxt, kv)), bits(ref)):
        fail("the decode step is not deterministic: the bitwise check would be moot")

    nb = 3 * n
    shape = (nb, BS, KV_HEADS, head_dim)
    K = [torch.randn(shape, dtype=dtype, device="cuda") for _ in range(LAYERS)]
    V = [torch.randn(shape, dtype=dtype, device="cuda") for _ in range(LAYERS)]
    perm = torch.randperm(nb, generator=g).tolist()
    save_ids, load_ids = perm[:n], perm[n:2 * n]       # disjoint block ids
    to_blocks(kv, K, V, save_ids, head_dim)
    if not torch.equal(bits(from_blocks(K, V, save_ids, head_dim)[0][0]), bits(kv[0][0])):
        fail("paged copy of the prompt KV does not round-trip")
    with kvplane.Device("cuda") as dev:
        snapshot = save_and_load(dev, K, V, tokens.tolist(), save_ids, load_ids,
                                 a.dtype)
    check_restored(K, V, snapshot, load_ids)
    got = decode(model, nxt, from_blocks(K, V, load_ids, head_dim))
    if not torch.equal(bits(got), bits(ref)):
        d = (got.float() - ref.float()).abs().max().item()
        fail(f"next-token logits differ after the reload (max |diff| {d})")
    print(f"PASS: {n} blocks ({n * BS} tokens) saved from blocks {save_ids[:4]}..., "
          f"loaded into {load_ids[:4]}...; next-token logits bit-identical "
          f"(argmax {int(got.argmax())})")


if __name__ == "__main__":
    main()
