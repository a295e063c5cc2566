# SPDX-License-Identifier: Apache-2.0
"""The locality index (include/kvplane/index.h): block key -> the (worker,
tier) pairs holding it.  Thread-safe as the C index is: events of different
workers and queries may run from any threads (the GIL is released in C)."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Callable, Dict, List, Optional

from ._kvplane import ffi, lib
from ._util import (TIER_COUNT, Key, KeysLike, Tier, TierLike, as_keys, check,
                    key_struct, tier_of)


@dataclass
class Match:
    """One worker's match for a chain: the longest prefix it holds, each
    block counted in the fastest tier holding it (``tier_blocks``) or in
    ``routed_blocks`` (approximate mode)."""
    worker: int
    prefix_blocks: int
    tier_blocks: Dict[Tier, int]
    routed_blocks: int
    uncertain: bool


@dataclass
class IndexStats:
    keys: int
    residencies: int
    routed: int
    bytes: int
    workers: int
    uncertain_workers: int
    events_applied: int
    events_stale: int
    seq_gaps: int
    events_unknown_worker: int
    events_invalid: int
    orphan_stores: int
    resyncs: int
    routed_expired: int
    routed_evicted: int
    queries: int
    query_blocks: int
    closure_violations: int
    epochs: int
    epoch_drops: int


def struct_fields(cls: Any, c: Any) -> Any:
    """A dataclass of scalar fields copied from a C struct of the same names."""
    return cls(**{f.name: getattr(c, f.name) for f in fields(cls)})


class Index:
    """kvp_index.  ``max_workers`` 0 = KVP_WORKERS_MAX; ``prefix_closed``
    lets queries on <= 64 workers bisect (see index.h)."""

    def __init__(self, max_workers: int = 0, approx_capacity: int = 0,
                 approx_ttl_s: float = 0.0, expected_keys: int = 0,
                 prefix_closed: bool = False) -> None:
        o = ffi.new("kvp_index_opts *")
        o.max_workers, o.approx_capacity = max_workers, approx_capacity
        o.approx_ttl_ns = int(approx_ttl_s * 1e9)
        o.expected_keys, o.prefix_closed = expected_keys, int(prefix_closed)
        out = ffi.new("kvp_index **")
        check(lib.kvp_index_create(o, ffi.NULL, out), "Index")
        self._ix = ffi.gc(out[0], lib.kvp_index_destroy)
        self.max_workers = max_workers or int(lib.KVP_WORKERS_MAX)

    # ---- workers and events -------------------------------------------------
    def add_worker(self, worker: int) -> None:
        check(lib.kvp_index_worker_add(self._ix, worker), f"Index.add_worker({worker})")

    def remove_worker(self, worker: int) -> None:
        check(lib.kvp_index_worker_remove(self._ix, worker), f"Index.remove_worker({worker})")

    def stored(self, worker: int, seq: int, keys: KeysLike, tier: TierLike = Tier.HBM,
               parent: Optional[Key] = None) -> int:
        """keys (a run of one chain; ``parent`` the key before it, None at
        the root) are now in ``tier`` on ``worker``; returns how many are
        newly resident.  A stale ``seq`` raises StateError (KVP_EEXIST)."""
        k = as_keys(keys)
        p = ffi.NULL if parent is None else ffi.new("kvp_key *", key_struct(parent))
        return check(lib.kvp_index_stored(self._ix, worker, seq, tier_of(tier), p,
                                          k.ptr, len(k)), "Index.stored")

    def removed(self, worker: int, seq: int, keys: KeysLike,
                tier: TierLike = Tier.HBM) -> int:
        k = as_keys(keys)
        return check(lib.kvp_index_removed(self._ix, worker, seq, tier_of(tier),
                                           k.ptr, len(k)), "Index.removed")

    def cleared(self, worker: int, seq: int) -> None:
        check(lib.kvp_index_cleared(self._ix, worker, seq), "Index.cleared")

    def src_stored(self, worker: int, stream: int, epoch: int, seq: int,
                   keys: KeysLike, tier: TierLike, parent: Optional[Key] = None) -> int:
        """As stored(), for event stream ``stream`` of the worker at
        ``epoch`` (a kvtier store publishes on its own stream)."""
        k = as_keys(keys)
        p = ffi.NULL if parent is None else ffi.new("kvp_key *", key_struct(parent))
        return check(lib.kvp_index_src_stored(self._ix, _src(worker, stream, epoch, seq),
                                              tier_of(tier), p, k.ptr, len(k)),
                     "Index.src_stored")

    def src_removed(self, worker: int, stream: int, epoch: int, seq: int,
                    keys: KeysLike, tier: TierLike) -> int:
        k = as_keys(keys)
        return check(lib.kvp_index_src_removed(self._ix, _src(worker, stream, epoch, seq),
                                               tier_of(tier), k.ptr, len(k)),
                     "Index.src_removed")

    def tier_publisher(self, worker: int, stream: int = 1) -> Callable[[Any], None]:
        """A TierStore ``on_event`` callback that applies the store's events
        to this index as stream ``stream`` of ``worker`` (its epoch is the
        store's).  Errors are counted by the index (stats), never raised
        into the store."""
        def publish(ev: Any) -> None:
            k = ffi.new("kvp_key *", key_struct(ev.key))
            s = _src(worker, stream, ev.epoch, ev.seq)
            if ev.stored:
                lib.kvp_index_src_stored(self._ix, s, int(ev.tier), ffi.NULL, k, 1)
            else:
                lib.kvp_index_src_removed(self._ix, s, int(ev.tier), k, 1)
        return publish

    def resync_from_store(self, worker: int, stream: int, store: Any) -> int:
        """Rebuild the residency a TierStore publishes as ``stream`` of
        ``worker`` from what the store holds now (after a restart: its new
        epoch replaces the old one's DRAM/NVMe residency).  Returns the
        number of distinct keys resident in those tiers."""
        items, seq = store.residents()
        n = len(items)
        keys = ffi.new("kvp_key[]", max(n, 1))
        tiers = ffi.new("uint8_t[]", max(n, 1))
        for i, r in enumerate(items):
            keys[i].hi, keys[i].lo, tiers[i] = r.key.hi, r.key.lo, int(r.tier)
        mask = (1 << Tier.DRAM) | (1 << Tier.NVME)
        return check(lib.kvp_index_src_resync(self._ix, _src(worker, stream, store.epoch, seq),
                                              mask, keys, tiers, n),
                     "Index.resync_from_store")

    # ---- approximate mode ---------------------------------------------------
    def record_routed(self, worker: int, keys: KeysLike, now_ns: Optional[int] = None) -> int:
        k = as_keys(keys)
        now = lib.kvp_now_ns() if now_ns is None else now_ns
        return check(lib.kvp_index_record_routed(self._ix, worker, k.ptr, len(k), now),
                     "Index.record_routed")

    # ---- queries --------------------------------------------------------------
    def query(self, keys: KeysLike, now_ns: int = 0) -> List[Match]:
        """Every worker holding at least the chain's first block, by worker id."""
        k = as_keys(keys)
        cap = 64
        while True:
            out = ffi.new("kvp_index_match[]", cap)
            n = check(lib.kvp_index_query(self._ix, k.ptr, len(k), now_ns, out, cap),
                      "Index.query")
            if n <= cap:
                return [_match(out[i]) for i in range(n)]
            cap = n

    def digest(self, worker: int) -> int:
        d = ffi.new("uint64_t *")
        check(lib.kvp_index_digest(self._ix, worker, d), "Index.digest")
        return int(d[0])

    def stats(self) -> IndexStats:
        s = ffi.new("kvp_index_stats *")
        check(lib.kvp_index_stats_get(self._ix, s), "Index.stats")
        return struct_fields(IndexStats, s)

    def close(self) -> None:
        """Frees the index now (no other call may be in flight)."""
        if self._ix is not None:
            ffi.release(self._ix)
            self._ix = None

    def __enter__(self) -> "Index":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _src(worker: int, stream: int, epoch: int, seq: int) -> Any:
    s = ffi.new("kvp_index_src *")
    s.worker, s.stream, s.epoch, s.seq = worker, stream, epoch, seq
    return s


def _match(m: Any) -> Match:
    return Match(int(m.worker), int(m.prefix_blocks),
                 {Tier(t): int(m.tier_blocks[t]) for t in range(TIER_COUNT)},
                 int(m.routed_blocks), bool(m.uncertain))
