# SPDX-License-Identifier: Apache-2.0
"""The device side on the CPU backend (host pointers): gather/scatter of
numpy paged caches against a numpy reference, TierLink save -> load into
other block ids, and the shape/dtype checks.  The GPU run of the same path
is tests/e2e/llama_reuse.py."""
import numpy as np
import pytest

import kvplane
from kvplane import Tier

LAYERS, NB, BS, H, D = 3, 12, 16, 2, 32


def paged_cache(seed=0, dtype=np.float16, layers=LAYERS, nb=NB):
    """vLLM NHD: per layer K and V [num_blocks, block_size, kv_heads, head_dim]."""
    rng = np.random.default_rng(seed)
    mk = lambda: rng.standard_normal((nb, BS, H, D)).astype(dtype)  # noqa: E731
    return [mk() for _ in range(layers)], [mk() for _ in range(layers)]


def reference_slot(k, v, b):
    """What kvplane stages for block b: layer 0 K, layer 0 V, layer 1 K, ..."""
    return np.concatenate([np.concatenate([k[l][b].view(np.uint8).ravel(),
                                           v[l][b].view(np.uint8).ravel()])
                           for l in range(len(k))])


def poison(arrays):
    for a in arrays:
        a.view(np.uint16)[...] = 0x7E00  # fp16 NaN


@pytest.fixture
def dev():
    with kvplane.Device("cpu") as d:
        yield d


def test_layout_info(dev):
    k, v = paged_cache()
    lay = kvplane.KvLayout(dev, k, v)
    page = BS * H * D * 2
    assert (lay.num_layers, lay.num_blocks, lay.block_size) == (LAYERS, NB, BS)
    assert lay.block_bytes == 2 * LAYERS * page
    info = lay.info()
    assert (info.n_chunks, info.chunk_bytes, info.block_stride) == (2 * LAYERS, page, page)


def test_gather_scatter_round_trip(dev):
    k, v = paged_cache(1)
    lay = kvplane.KvLayout(dev, k, v)
    ids = [7, 0, 11, 3, 3]                      # repeats are fine in a gather
    staging = np.full((len(ids), lay.block_bytes), 0xA5, dtype=np.uint8)
    assert lay.gather(ids, staging) in ("kernel", "copy_engine")
    for i, b in enumerate(ids):
        assert np.array_equal(staging[i], reference_slot(k, v, b)), i
    # into other, poisoned blocks; every other block untouched
    k2, v2 = paged_cache(2)
    before = [a.copy() for a in k2 + v2]
    for a in k2 + v2:
        a[[1, 2, 4]] = np.nan                           # poisoned targets
    lay2 = kvplane.KvLayout(dev, k2, v2)
    lay2.scatter([4, 2, 1], staging[:3])
    for l in range(LAYERS):
        for src, dst in ((7, 4), (0, 2), (11, 1)):
            assert np.array_equal(k2[l][dst].view(np.uint16), k[l][src].view(np.uint16))
            assert np.array_equal(v2[l][dst].view(np.uint16), v[l][src].view(np.uint16))
    rest = [b for b in range(NB) if b not in (1, 2, 4)]
    for a, b0 in zip(k2 + v2, before):
        assert np.array_equal(a[rest].view(np.uint16), b0[rest].view(np.uint16))


def test_gather_into_slots(dev):
    k, v = paged_cache(3)
    lay = kvplane.KvLayout(dev, k, v)
    staging = np.zeros((4, lay.block_bytes), dtype=np.uint8)
    lay.gather([5, 6], staging, slots=[3, 1])
    assert np.array_equal(staging[3], reference_slot(k, v, 5))
    assert np.array_equal(staging[1], reference_slot(k, v, 6))
    assert not staging[[0, 2]].any()


def test_other_kinds(dev):
    rng = np.random.default_rng(4)
    kv = [rng.standard_normal((2, NB, BS, H, D)).astype(np.float32) for _ in range(2)]
    lay = kvplane.KvLayout(dev, kv, kind="vllm_nhd_kv")
    out = np.empty((1, lay.block_bytes), dtype=np.uint8)
    lay.gather([9], out)
    assert np.array_equal(out[0], reference_slot([t[0] for t in kv], [t[1] for t in kv], 9))
    cross = rng.standard_normal((NB, 2, 2, BS, H, D)).astype(np.float16)
    cl = kvplane.KvLayout(dev, cross, kind="cross_layer")
    assert (cl.num_layers, cl.block_bytes) == (2, cross[0].nbytes)
    cl.gather([5], out[:, :cl.block_bytes])
    assert np.array_equal(out[0, :cl.block_bytes], cross[5].view(np.uint8).ravel())


def test_vllm_kv_layout(dev):
    """kvplane.vllm's choice of layout for a vLLM worker's KV cache: the
    FlashAttention K/V planes as vllm_nhd_kv, blocks-first layouts whole."""
    rng = np.random.default_rng(6)
    fa = {f"l{i}": rng.standard_normal((2, NB, BS, H, D)).astype(np.float16)
          for i in range(2)}
    lay, tag = kvplane.vllm_kv_layout(dev, fa, NB, BS)
    assert (lay.kind, lay.num_layers, tag) == ("vllm_nhd_kv", 2, f"kv2:{BS}x{H}x{D}")
    out = np.empty((1, lay.block_bytes), dtype=np.uint8)
    lay.gather([7], out)
    ks, vs = [t[0] for t in fa.values()], [t[1] for t in fa.values()]
    assert np.array_equal(out[0], reference_slot(ks, vs, 7))
    # the CPU backend's [NB, H, BS, 2D]: each block one run, moved whole
    cpu = {f"l{i}": rng.standard_normal((NB, H, BS, 2 * D)).astype(np.float16)
           for i in range(3)}
    lay2, tag2 = kvplane.vllm_kv_layout(dev, cpu, NB, BS)
    assert (lay2.kind, lay2.num_layers, tag2) == ("mla", 3, f"{H}x{BS}x{2 * D}")
    out2 = np.empty((1, lay2.block_bytes), dtype=np.uint8)
    lay2.gather([5], out2)
    want = np.concatenate([t[5].view(np.uint8).ravel() for t in cpu.values()])
    assert np.array_equal(out2[0], want)
    assert tag2 != tag
    with pytest.raises(ValueError, match="not contiguous"):
        kvplane.vllm_kv_layout(dev, {"l0": cpu["l0"][:, :, :, :D]}, NB, BS)
    with pytest.raises(ValueError, match="neither blocks first"):
        kvplane.vllm_kv_layout(dev, {"l0": np.zeros((H, NB, BS, D), np.float16)}, NB, BS)
    with pytest.raises(ValueError, match="layer l1's KV cache has shape"):
        kvplane.vllm_kv_layout(dev, {"l0": fa["l0"], "l1": fa["l1"][:, :, :, :1].copy()},
                               NB, BS)
    with pytest.raises(ValueError, match="not a multiple of block size"):
        kvplane.vllm_kv_layout(dev, {"l0": np.zeros((NB, 3, 5), np.float16)}, NB, BS)
    with pytest.raises(ValueError, match="no KV cache tensors"):
        kvplane.vllm_kv_layout(dev, {}, NB, BS)


class TorchLike:
    """What KvLayout reads of a torch tensor: data_ptr(), shape, dtype,
    element_size(), is_contiguous(), device.type."""

    class device:
        type = "cpu"

    def __init__(self, a):
        self.a, self.shape, self.dtype = a, a.shape, "torch.bfloat16"

    def data_ptr(self):
        return self.a.__array_interface__["data"][0]

    def element_size(self):
        return self.a.itemsize

    def is_contiguous(self):
        return self.a.flags.c_contiguous


def test_torch_like_tensors(dev):
    k, v = paged_cache(5)
    lay = kvplane.KvLayout(dev, [TorchLike(a) for a in k], [TorchLike(a) for a in v])
    out = np.empty((1, lay.block_bytes), dtype=np.uint8)
    lay.gather([2], out)
    assert np.array_equal(out[0], reference_slot(k, v, 2))


@pytest.mark.parametrize("case,match", [
    ("v_count", "one V tensor per K"),
    ("ndim", r"tensors are \[NB,BS,H,D\]"),
    ("shape", "tensor 4 has shape"),
    ("dtype", "tensor 1 is"),
    ("float64", "8-byte elements"),
    ("strided", "not C-contiguous"),
    ("readonly", "read-only"),
    ("kind", "kind 'paged'"),
    ("not_tensor", "expected a torch tensor or a numpy array"),
])
def test_bad_layouts_raise(dev, case, match):
    k, v = paged_cache()
    kind = "vllm_nhd"
    if case == "v_count":
        v = v[:-1]
    elif case == "ndim":
        k = [a.reshape(NB, BS, H * D) for a in k]
        v = [a.reshape(NB, BS, H * D) for a in v]
    elif case == "shape":
        v[1] = v[1][:-1].copy()
    elif case == "dtype":
        k[1] = k[1].astype(np.float32)
    elif case == "float64":
        k, v = [a.astype(np.float64) for a in k], [a.astype(np.float64) for a in v]
    elif case == "strided":
        k[0] = np.zeros((NB, BS, H, 2 * D), np.float16)[..., ::2]
    elif case == "readonly":
        v[2].flags.writeable = False
    elif case == "kind":
        kind = "paged"
    elif case == "not_tensor":
        k[0] = k[0].tolist()
    with pytest.raises((ValueError, TypeError), match=match):
        kvplane.KvLayout(dev, k, v, kind=kind)


def test_bad_transfers_raise(dev):
    k, v = paged_cache()
    lay = kvplane.KvLayout(dev, k, v)
    staging = np.zeros((2, lay.block_bytes), dtype=np.uint8)
    with pytest.raises(kvplane.InvalidArgumentError):
        lay.gather([NB], staging)                        # id out of range
    with pytest.raises(kvplane.KvplaneError):
        lay.gather([0, 1], staging[:1])                  # staging too short
    with pytest.raises(kvplane.InvalidArgumentError):
        lay.scatter([3, 3], staging)                     # repeated id
    with pytest.raises(ValueError, match="2 slots for 1"):
        lay.gather([0], staging, slots=[0, 1])
    with pytest.raises(ValueError, match="method"):
        lay.gather([0], staging, method="dma")


def test_backend_availability():
    ok, why = kvplane.backend_available("cpu")
    assert ok, why
    ok, why = kvplane.backend_available("cuda")
    if not ok:
        assert why
        with pytest.raises(kvplane.KvplaneError) as e:
            kvplane.Device("cuda")
        assert e.value.name == "KVP_ENOTSUP" and why in e.value.message + str(e.value)
    with pytest.raises(ValueError, match="backend"):
        kvplane.Device("tpu")


def test_tier_link_save_load_other_ids(dev, hasher):
    ns = kvplane.Namespace("m", BS, kv_layout="vllm-nhd:fp16")
    h = kvplane.Hasher(ns)
    k, v = paged_cache(6)
    lay = kvplane.KvLayout(dev, k, v)
    keys = h.hash(range(4 * BS + 3))                     # 4 chained block keys
    saved_from = [8, 1, 10, 5]
    ref = [reference_slot(k, v, b) for b in saved_from]
    with kvplane.TierStore(dram_bytes=16 << 20, device=dev) as store:
        store.add_namespace(ns, block_bytes=lay.block_bytes)
        link = kvplane.TierLink(store, dev, lay, ns)
        assert link.save(keys, saved_from) == [1, 1, 1, 1]
        poison(k + v)
        load_into = [0, 11, 2, 9]
        got = link.load(keys, load_into)
        assert got == [Tier.DRAM] * 4
        for i, b in enumerate(load_into):
            assert np.array_equal(reference_slot(k, v, b), ref[i]), i
        left = [b for b in range(NB) if b not in load_into]
        assert all(np.isnan(a[left].astype(np.float32)).all() for a in k + v)
        st = link.stats()
        assert (st.saves, st.loads, st.blocks_saved, st.blocks_loaded) == (1, 1, 4, 4)
        # a key never saved misses and leaves its block alone
        other = h.hash(range(1000, 1000 + BS))
        assert link.load(other, [3]) == [None]
        assert np.isnan(k[0][3].astype(np.float32)).all()
        with pytest.raises(ValueError, match="4 keys for 3 block ids"):
            link.save(keys, [0, 1, 2])
        with pytest.raises(kvplane.InvalidArgumentError):
            link.load(keys[:2], [4, 4])                  # repeated target id
    assert link._k is None                               # closed with the store


def test_device_close_closes_children(hasher):
    dev = kvplane.Device("cpu")
    k, v = paged_cache()
    lay = kvplane.KvLayout(dev, k, v)
    buf = np.zeros(1 << 16, dtype=np.uint8)
    dev.host_register(buf)
    with pytest.raises(kvplane.KvplaneError):
        dev.host_register(buf)                           # overlaps: KVP_EEXIST
    dev.close()
    assert lay._l is None
    with pytest.raises(ValueError, match="closed"):
        lay.gather([0], np.zeros((1, 1 << 20), np.uint8))


def test_finalization_order_is_safe(hasher):
    """Collected in a cycle, a store may be finalized before its link (the
    links' weak set is already cleared): its handle then waits for the link."""
    dev = kvplane.Device("cpu")
    k, v = paged_cache()
    lay = kvplane.KvLayout(dev, k, v)
    ns = kvplane.Namespace("m", BS, kv_layout="vllm-nhd:fp16")
    store = kvplane.TierStore(dram_bytes=16 << 20, device=dev)
    store.add_namespace(ns, block_bytes=lay.block_bytes)
    link = kvplane.TierLink(store, dev, lay, ns)
    store._links.clear()
    dev._children.clear()                                # as in a collected cycle
    store.close(), lay.close(), dev.close()
    assert store._owner.ptr is not None and dev._owner.ptr is not None
    keys = kvplane.Hasher(ns).hash(range(BS))
    assert link.save(keys, [0]) == [1]                   # everything still alive
    link.close()
    assert store._owner.ptr is None and lay._owner.ptr is None
    assert dev._owner.ptr is None


def test_cycle_collected(hasher):
    import gc
    dev = kvplane.Device("cpu")
    k, v = paged_cache()
    lay = kvplane.KvLayout(dev, k, v)
    ns = kvplane.Namespace("m", BS, kv_layout="vllm-nhd:fp16")
    store = kvplane.TierStore(dram_bytes=16 << 20, device=dev)
    store.add_namespace(ns, block_bytes=lay.block_bytes)
    link = kvplane.TierLink(store, dev, lay, ns)
    cycle = [dev, lay, store, link]
    cycle.append(cycle)
    owners = [o._owner for o in cycle[:4]]
    del dev, lay, store, link, cycle
    gc.collect()
    assert all(o.ptr is None for o in owners)
