# SPDX-License-Identifier: Apache-2.0
"""The engine-side KV block store (include/kvplane/tier.h): DRAM, then slab
files on NVMe.  Thread-safe (one store lock; the GIL is released while C
copies or does I/O).  Buffers go in and out through the buffer protocol
(bytes, bytearray, memoryview, numpy arrays) or data_ptr() (CPU tensors),
without copies on the Python side."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence, Tuple, Union

from ._kvplane import ffi, lib
from ._util import (ClassLike, Key, KeysLike, Owner, StabilityClass, Tier, as_keys, check,
                    class_of, error, cstr, key_struct, read_buffer, write_buffer)
from .index import struct_fields
from .prefix import Namespace

KeyLike = Union[Key, tuple, int]


@dataclass
class TierEvent:
    """A block entered (stored=True) or left a tier of the store."""
    seq: int
    tier: Tier
    stored: bool
    ns: Key
    key: Key
    bytes: int
    epoch: int


@dataclass
class Resident:
    """One resident block, once per tier holding it."""
    ns: Key
    key: Key
    tier: Tier
    bytes: int


@dataclass
class TierStats:
    puts: int
    puts_dup: int
    puts_rejected: int
    misses: int
    demotions: int
    promotions: int
    nvme_writes: int
    nvme_reads: int
    checksum_failures: int
    recovered_slots: int
    dram_blocks: int
    nvme_blocks: int
    dram_used_bytes: int
    nvme_used_bytes: int
    dram_bytes: int
    nvme_bytes: int
    io_uring: int


def _key(k: Any) -> Key:
    return Key(int(k.hi), int(k.lo))


@ffi.def_extern()
def kvp_py_tier_event(opaque: Any, ev: Any) -> None:
    store = ffi.from_handle(opaque)
    e = TierEvent(int(ev.seq), Tier(ev.tier), bool(ev.stored), _key(ev.ns),
                  _key(ev.key), int(ev.bytes), int(ev.epoch))
    try:
        store._on_event(e)
    except BaseException as exc:  # never unwind into C; re-raised later
        store._event_errors.append(exc)


@ffi.def_extern()
def kvp_py_tier_resident(opaque: Any, r: Any) -> int:
    ffi.from_handle(opaque).append(Resident(_key(r.ns), _key(r.key), Tier(r.tier),
                                            int(r.bytes)))
    return 0


_BACKENDS = {"auto": lib.KVP_TIER_IO_AUTO, "uring": lib.KVP_TIER_IO_URING,
             "posix": lib.KVP_TIER_IO_POSIX}


class TierStore:
    """kvp_tier_store.  ``dram_bytes`` sizes the DRAM tier (0: a fraction of
    MemAvailable); ``nvme_dir`` (an existing directory) adds the NVMe tier,
    recovered from its slab files at open.  ``on_event(TierEvent)`` is
    called under the store's lock for every block entering or leaving a
    tier: it must not call back into the store (Index.tier_publisher()
    gives one that feeds an Index).  An exception it raises is re-raised
    by the store call that triggered it.  ``device`` (a kvplane.Device)
    registers the DRAM region with it, so TierLinks on that device move
    blocks straight between the engine's cache and the DRAM slots; the
    store keeps the device alive and closes before it.  ``queue_depth``:
    NVMe I/Os in flight (0: 32).  ``TierStore.from_config(yaml)`` takes the
    YAML ``tiers:`` section instead."""

    def __init__(self, dram_bytes: int = 0, nvme_dir: Optional[str] = None,
                 nvme_bytes: int = 0, io_backend: str = "auto",
                 policy: str = "lru", admission: Optional[str] = None,
                 volatile_nvme_min_hits: int = 0, promote: bool = True,
                 on_event: Optional[Callable[[TierEvent], None]] = None,
                 device: Any = None, queue_depth: int = 0) -> None:
        self._t = None
        self._links: "weakref.WeakSet[Any]" = weakref.WeakSet()
        keep: list = []
        o = ffi.new("kvp_tier_opts *")
        o.dram_bytes, o.nvme_bytes = dram_bytes, nvme_bytes
        o.nvme_dir = cstr(nvme_dir, keep)
        o.io_backend = _BACKENDS[io_backend]
        pk = ffi.new("kvp_tier_policy_kind *")
        check(lib.kvp_tier_policy_parse(policy.encode(), pk), f"policy {policy!r}")
        o.policy = pk[0]
        if admission is not None:
            ak = ffi.new("kvp_tier_admission *")
            check(lib.kvp_tier_admission_parse(admission.encode(), ak), "admission")
            o.admission = ak[0]
        o.volatile_nvme_min_hits, o.no_promote = volatile_nvme_min_hits, int(not promote)
        o.queue_depth = queue_depth
        self._open(o, on_event, device)

    @classmethod
    def from_config(cls, yaml: str, device: Any = None,
                    on_event: Optional[Callable[[TierEvent], None]] = None) -> "TierStore":
        """A store configured by the ``tiers:`` section of a kvplane YAML
        config (kvp_tier_opts_from_config: the keys and ranges of
        docs/config.md; an unknown key or a bad value raises
        InvalidArgumentError naming it).  ``device``/``on_event`` as in
        the constructor."""
        t = cls.__new__(cls)
        t._t = None
        t._links = weakref.WeakSet()
        data, err = yaml.encode(), ffi.new("char[512]")
        cfg = ffi.new("kvp_config **")
        rc = lib.kvp_config_load_mem(data, len(data), b"TierStore.from_config",
                                     ffi.NULL, cfg, err, 512)
        check(rc, f"TierStore.from_config: {ffi.string(err).decode()}")
        o, t._dir = ffi.new("kvp_tier_opts *"), ffi.new("char[4096]")
        try:
            rc = lib.kvp_tier_opts_from_config(cfg[0], o, t._dir, 4096, err, 512)
        finally:
            lib.kvp_config_destroy(cfg[0])
        check(rc, f"TierStore.from_config: {ffi.string(err).decode()}")
        t._open(o, on_event, device)
        return t

    def _open(self, o: Any, on_event: Optional[Callable[[TierEvent], None]],
              device: Any) -> None:
        self._on_event = on_event
        self._event_errors: List[BaseException] = []
        self._handle = ffi.new_handle(self)
        if on_event is not None:
            o.on_event, o.event_opaque = lib.kvp_py_tier_event, self._handle
        if device is not None:  # its DRAM region registered with the device
            check(lib.kvp_tier_opts_set_device(o, device._live()), "TierStore(device)")
        out = ffi.new("kvp_tier_store **")
        check(lib.kvp_tier_create(o, ffi.NULL, out), "TierStore")
        self._t = out[0]
        self._owner = Owner(self._t, lib.kvp_tier_destroy,
                            [device._owner] if device is not None else [])
        nvme_dir = ffi.string(o.nvme_dir).decode() if o.nvme_dir != ffi.NULL else None
        self.nvme_dir, self.device = nvme_dir, device
        if device is not None:
            device._children.add(self)

    def _raise_event_errors(self) -> None:
        if self._event_errors:
            exc = self._event_errors.pop(0)
            self._event_errors.clear()
            raise exc

    def _check(self, rc: int, where: str) -> int:
        self._raise_event_errors()
        return check(rc, where)

    def _live(self) -> Any:
        if self._t is None:
            raise ValueError("TierStore is closed")
        return self._t

    def add_namespace(self, ns: Namespace, block_bytes: int = 0,
                      aes256_key: Optional[bytes] = None) -> None:
        """Register a namespace; ``block_bytes`` > 0 gives it fixed-size DRAM
        slots; ``aes256_key`` (32 bytes) encrypts its NVMe slots."""
        o = ffi.new("kvp_tier_ns_opts *")
        o.block_bytes = block_bytes
        key = ffi.from_buffer(aes256_key) if aes256_key is not None else ffi.NULL
        if aes256_key is not None and len(aes256_key) != 32:
            raise ValueError("aes256_key must be 32 bytes")
        o.aes256_key = ffi.cast("const uint8_t *", key)
        check(lib.kvp_tier_ns_add(self._live(), ns._ns, o), "TierStore.add_namespace")

    def put(self, ns: Namespace, key: KeyLike, data: Any,
            cls: ClassLike = StabilityClass.VOLATILE, durable: bool = False) -> None:
        """Store a copy of ``data`` under (ns, key); a key already stored is
        a no-op.  ``durable`` writes through to NVMe and fdatasyncs."""
        ptr, n, _keep = read_buffer(data)
        po = ffi.new("kvp_tier_put_opts *")
        po.cls = class_of(cls)
        po.flags = lib.KVP_TIER_PUT_DURABLE if durable else 0
        self._check(lib.kvp_tier_put(self._live(), ns._ns, key_struct(key), ptr, n, po),
                    "TierStore.put")

    def get_into(self, ns: Namespace, key: KeyLike, out: Any) -> Optional[Tuple[Tier, int]]:
        """Copy the block into ``out`` (a writable buffer: bytearray,
        memoryview, numpy array, CPU tensor).  Returns (tier served from,
        bytes), or None on a miss; a buffer too small raises
        InvalidArgumentError (KVP_ERANGE) naming the size needed."""
        ptr, cap, _keep = write_buffer(out)
        n = ffi.new("size_t *")
        rc = lib.kvp_tier_get(self._live(), ns._ns, key_struct(key), ptr, cap, n)
        self._raise_event_errors()
        if rc == lib.KVP_ENOENT:
            return None
        if rc == lib.KVP_ERANGE:
            raise error(rc, f"TierStore.get_into: buffer of {cap} bytes, block "
                        f"needs {int(n[0])}")
        check(rc, "TierStore.get_into")
        return Tier(rc), int(n[0])

    def get(self, ns: Namespace, key: KeyLike) -> Optional[bytes]:
        """The block's bytes, or None on a miss."""
        n = ffi.new("size_t *")
        t = self._live()
        while True:
            rc = lib.kvp_tier_get(t, ns._ns, key_struct(key), ffi.NULL, 0, n)
            if rc == lib.KVP_ENOENT:
                self._raise_event_errors()
                return None
            if rc != lib.KVP_ERANGE:
                self._check(rc, "TierStore.get")
            buf = bytearray(int(n[0]))
            got = self.get_into(ns, key, buf)
            if got is not None and got[1] == len(buf):
                return bytes(buf)
            if got is None:
                return None

    def contains(self, ns: Namespace, key: KeyLike) -> Optional[Tier]:
        """The fastest tier holding the block, or None.  No I/O."""
        rc = lib.kvp_tier_contains(self._live(), ns._ns, key_struct(key))
        return None if rc == lib.KVP_ENOENT else Tier(check(rc, "TierStore.contains"))

    def evict(self, ns: Namespace, key: KeyLike) -> bool:
        return bool(self._check(lib.kvp_tier_evict(self._live(), ns._ns, key_struct(key)),
                                "TierStore.evict"))

    def put_batch(self, ns: Namespace, keys: KeysLike, blocks: Sequence[Any],
                  cls: ClassLike = StabilityClass.VOLATILE,
                  durable: bool = False) -> List[int]:
        """Store blocks[i] under keys[i]; per-item results (1 stored, or a
        negative code)."""
        k = as_keys(keys)
        if len(blocks) != len(k):
            raise ValueError("put_batch: one block per key")
        n = len(k)
        data, lens = ffi.new("void *[]", max(n, 1)), ffi.new("size_t[]", max(n, 1))
        keep = []
        for i, b in enumerate(blocks):
            p, ln, kp = read_buffer(b)
            data[i], lens[i] = p, ln
            keep.append(kp)
        po = ffi.new("kvp_tier_put_opts *")
        po.cls = class_of(cls)
        po.flags = lib.KVP_TIER_PUT_DURABLE if durable else 0
        res = ffi.new("int[]", max(n, 1))
        self._check(lib.kvp_tier_put_batch(self._live(), ns._ns, k.ptr, n, data, lens,
                                           po, res), "TierStore.put_batch")
        return [int(res[i]) for i in range(n)]

    def get_batch(self, ns: Namespace, keys: KeysLike,
                  outs: Sequence[Any]) -> List[Optional[Tuple[Tier, int]]]:
        """Read keys[i] into outs[i] (non-overlapping writable buffers);
        NVMe reads are submitted together.  Per item: (tier, bytes) or None
        (miss)."""
        k = as_keys(keys)
        if len(outs) != len(k):
            raise ValueError("get_batch: one buffer per key")
        n = len(k)
        dst, caps = ffi.new("void *[]", max(n, 1)), ffi.new("size_t[]", max(n, 1))
        lens, res = ffi.new("size_t[]", max(n, 1)), ffi.new("int[]", max(n, 1))
        keep = []
        for i, b in enumerate(outs):
            p, cap, kp = write_buffer(b)
            dst[i], caps[i] = p, cap
            keep.append(kp)
        self._check(lib.kvp_tier_get_batch(self._live(), ns._ns, k.ptr, n, dst, caps,
                                           lens, res), "TierStore.get_batch")
        out: List[Optional[Tuple[Tier, int]]] = []
        for i in range(n):
            r = int(res[i])
            if r == lib.KVP_ENOENT:
                out.append(None)
            else:
                check(r, f"TierStore.get_batch[{i}]")
                out.append((Tier(r), int(lens[i])))
        return out

    def sync(self) -> None:
        """fdatasync every slab file: blocks on NVMe are durable after it."""
        self._check(lib.kvp_tier_sync(self._live()), "TierStore.sync")

    def idle(self, budget_bytes: int) -> int:
        """Write up to budget_bytes of cold DRAM blocks to NVMe."""
        return self._check(lib.kvp_tier_idle(self._live(), budget_bytes), "TierStore.idle")

    def stats(self) -> TierStats:
        s = ffi.new("kvp_tier_stats *")
        check(lib.kvp_tier_stats_get(self._live(), s), "TierStore.stats")
        st = struct_fields(TierStats, s)
        st.hits = {Tier(t): int(s.hits[t]) for t in range(lib.KVP_TIER_COUNT_)}
        return st

    @property
    def epoch(self) -> int:
        """The epoch this store's events carry."""
        return int(lib.kvp_tier_epoch(self._live()))

    def residents(self) -> Tuple[List[Resident], int]:
        """Every resident block (once per tier) and the seq of the store's
        last event: its state as of (epoch, seq), for an index resync."""
        items: List[Resident] = []
        seq = ffi.new("uint64_t *")
        h = ffi.new_handle(items)
        check(lib.kvp_tier_keys_each(self._live(), lib.kvp_py_tier_resident, h, seq),
              "TierStore.residents")
        return items, int(seq[0])

    def bandwidth(self, tier: Tier) -> float:
        return float(lib.kvp_tier_bandwidth(self._live(), int(tier)))

    def close(self) -> None:
        """Destroy the store (does NOT sync: call sync() first for
        durability).  Closes its TierLinks first.  Idempotent."""
        for link in list(self._links):
            link.close()
        if self._t is not None:
            self._t = None
            self._owner.close()  # destroyed once its links are

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "TierStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
