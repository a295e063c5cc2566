# SPDX-License-Identifier: Apache-2.0
"""TierStore through the package: put/get through the buffer protocol
(bytes, bytearray, memoryview, numpy, a tensor-like data_ptr object),
batches, misses, events into an Index, and a restart on a real directory."""
import ctypes

import numpy as np
import pytest

import kvplane
from kvplane import Tier

MiB = 1 << 20


def blocks(hasher, n, size=4096):
    keys = hasher.hash(range(n * 16))
    rng = np.random.default_rng(7)
    return keys, [rng.integers(0, 255, size, dtype=np.uint8) for _ in range(n)]


class FakeTensor:
    """What the store reads from a torch CPU tensor: data_ptr(), nbytes,
    is_contiguous(), device.type."""

    class device:
        type = "cpu"

    def __init__(self, nbytes):
        self.buf = (ctypes.c_uint8 * nbytes)()
        self.nbytes = nbytes

    def data_ptr(self):
        return ctypes.addressof(self.buf)

    def is_contiguous(self):
        return True


def test_put_get_buffer_types(ns, hasher):
    keys, data = blocks(hasher, 6)
    with kvplane.TierStore(dram_bytes=32 * MiB) as t:
        t.add_namespace(ns)
        srcs = [bytes(data[0]), bytearray(data[1]), memoryview(bytes(data[2])), data[3],
                data[4].view(np.float32)]
        for k, s in zip(keys, srcs):
            t.put(ns, k, s)
        tensor = FakeTensor(4096)
        ctypes.memmove(tensor.buf, data[5].ctypes.data, 4096)
        t.put(ns, keys[5], tensor, cls="stable")
        for i in range(6):
            assert t.get(ns, keys[i]) == data[i].tobytes()
        out = np.zeros(1024, dtype=np.float32)
        assert t.get_into(ns, keys[4], out) == (Tier.DRAM, 4096)
        assert out.tobytes() == data[4].tobytes()
        into = FakeTensor(4096)
        assert t.get_into(ns, keys[3], into) == (Tier.DRAM, 4096)
        assert bytes(into.buf) == data[3].tobytes()
        mv = memoryview(bytearray(8192))
        assert t.get_into(ns, keys[0], mv[100:]) == (Tier.DRAM, 4096)
        assert mv[100:4196].tobytes() == data[0].tobytes()
        with pytest.raises(kvplane.InvalidArgumentError, match="needs 4096"):
            t.get_into(ns, keys[0], bytearray(100))
        with pytest.raises(BufferError):
            t.get_into(ns, keys[0], b"read-only")
        assert t.contains(ns, keys[0]) == Tier.DRAM and t.evict(ns, keys[0])
        assert t.get(ns, keys[0]) is None and t.contains(ns, keys[0]) is None
        st = t.stats()
        assert st.puts == 6 and st.dram_blocks == 5 and st.hits[Tier.DRAM] >= 8


def test_batches_and_unknown_namespace(ns, hasher):
    keys, data = blocks(hasher, 8)
    with kvplane.TierStore(dram_bytes=32 * MiB) as t:
        other = kvplane.Namespace("other-model", 16)
        with pytest.raises(kvplane.NotFoundError):
            t.put(other, keys[0], data[0])
        t.add_namespace(ns, block_bytes=4096)
        assert t.put_batch(ns, keys[:6], data[:6]) == [1] * 6
        outs = [np.empty(4096, np.uint8) for _ in range(8)]
        got = t.get_batch(ns, keys, outs)
        assert got[:6] == [(Tier.DRAM, 4096)] * 6 and got[6:] == [None, None]
        assert all((o == d).all() for o, d in zip(outs[:6], data[:6]))
    with pytest.raises(ValueError):
        t.get(ns, keys[0])  # closed


def test_events_feed_an_index(ns, hasher):
    keys, data = blocks(hasher, 4)
    ix = kvplane.Index(max_workers=4)
    ix.add_worker(3)
    seen = []
    pub = ix.tier_publisher(worker=3, stream=1)

    def on_event(ev):
        seen.append(ev)
        pub(ev)
    with kvplane.TierStore(dram_bytes=32 * MiB, on_event=on_event) as t:
        t.add_namespace(ns)
        for k, d in zip(keys, data):
            t.put(ns, k, d)
        t.evict(ns, keys[3])
        assert [(e.seq, e.stored) for e in seen] == [(1, True), (2, True), (3, True),
                                                    (4, True), (5, False)]
        assert all(e.epoch == t.epoch and e.ns == ns.seed for e in seen)
        m = ix.query(keys)
        assert [(x.worker, x.prefix_blocks, x.tier_blocks[Tier.DRAM]) for x in m] == [(3, 3, 3)]


def test_event_callback_errors_surface(ns, hasher):
    keys, data = blocks(hasher, 1)

    def boom(ev):
        raise RuntimeError("callback failed")
    with kvplane.TierStore(dram_bytes=16 * MiB, on_event=boom) as t:
        t.add_namespace(ns)
        with pytest.raises(RuntimeError, match="callback failed"):
            t.put(ns, keys[0], data[0])


def test_restart_recovers_durable_blocks(ns, hasher, o_direct_dir):
    keys, data = blocks(hasher, 6, size=8192)
    opts = dict(dram_bytes=32 * MiB, nvme_dir=str(o_direct_dir), nvme_bytes=64 * MiB)
    with kvplane.TierStore(**opts) as t:
        t.add_namespace(ns)
        for i in range(3):
            t.put(ns, keys[i], data[i], cls="stable", durable=True)
        for i in range(3, 6):  # DRAM only, then written back and synced
            t.put(ns, keys[i], data[i], cls="semi")
        assert t.idle(1 << 30) >= 1
        t.sync()
        epoch = t.epoch
    ix = kvplane.Index(max_workers=1)
    ix.add_worker(0)
    with kvplane.TierStore(**opts, on_event=ix.tier_publisher(0)) as t:
        t.add_namespace(ns)
        assert t.epoch > epoch and t.stats().recovered_slots >= 3
        assert ix.resync_from_store(0, 1, t) >= 3
        m = ix.query(keys[:3])
        assert m[0].prefix_blocks == 3 and m[0].tier_blocks[Tier.NVME] == 3
        res, seq = t.residents()
        assert {r.key for r in res if r.tier == Tier.NVME} >= set(keys[:3])
        for i in range(3):
            out = bytearray(8192)
            assert t.get_into(ns, keys[i], out) == (Tier.NVME, 8192)
            assert bytes(out) == data[i].tobytes()
        recovered = [i for i in range(3, 6) if t.get(ns, keys[i]) == data[i].tobytes()]
        assert len(recovered) == t.stats().recovered_slots - 3


def test_dram_only_store_forgets_on_restart(ns, hasher):
    keys, data = blocks(hasher, 1)
    with kvplane.TierStore(dram_bytes=16 * MiB) as t:
        t.add_namespace(ns)
        t.put(ns, keys[0], data[0])
    with kvplane.TierStore(dram_bytes=16 * MiB) as t:
        t.add_namespace(ns)
        assert t.get(ns, keys[0]) is None


def test_from_config_yaml_tiers_section(ns, hasher, o_direct_dir):
    """TierStore.from_config binds the YAML `tiers:` section (sizes with
    suffixes, nvme_dir, queue_depth) and refuses an unknown key by name."""
    keys, data = blocks(hasher, 2, size=8192)
    yaml = (f"tiers:\n  dram_bytes: 32M\n  nvme_dir: {o_direct_dir}\n"
            f"  nvme_bytes: 64M\n  queue_depth: 8\n  promote: false\n")
    with kvplane.TierStore.from_config(yaml) as t:
        st = t.stats()
        assert (st.dram_bytes, st.nvme_bytes) == (32_000_000, 64_000_000)  # SI
        assert t.nvme_dir == str(o_direct_dir)
        t.add_namespace(ns)
        t.put(ns, keys[0], data[0], cls="stable", durable=True)
        t.sync()
    with kvplane.TierStore.from_config(yaml) as t:  # the same files again
        t.add_namespace(ns)
        assert t.stats().recovered_slots >= 1
        assert t.get(ns, keys[0]) == data[0].tobytes()
        assert t.contains(ns, keys[0]) == Tier.NVME  # promote: false
    with pytest.raises(kvplane.InvalidArgumentError, match="dram_byte"):
        kvplane.TierStore.from_config("tiers:\n  dram_byte: 32M\n")
    with pytest.raises(kvplane.InvalidArgumentError, match="queue_depth"):
        kvplane.TierStore.from_config("tiers:\n  queue_depth: 100000\n")


def test_queue_depth_keyword(ns, hasher):
    with kvplane.TierStore(dram_bytes=8 * MiB, queue_depth=4) as t:
        t.add_namespace(ns)
        assert t.stats().dram_bytes == 8 * MiB
    with pytest.raises(kvplane.InvalidArgumentError):
        kvplane.TierStore(dram_bytes=8 * MiB, queue_depth=5000)
