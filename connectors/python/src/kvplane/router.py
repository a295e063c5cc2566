# SPDX-License-Identifier: Apache-2.0
"""Routing (include/kvplane/route.h): which worker serves the next request,
with a receipt that says why.  A Router is NOT thread-safe (one per routing
thread, or serialise calls), as the C router; report_bandwidth() excepted."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ._kvplane import ffi, lib
from ._util import (CLASS_COUNT, TIER_COUNT, KeysLike, StabilityClass, Tier,
                    TierLike, _s, as_keys, check, cstr, id64, tier_of)
from .index import Index
from .prefix import Classification


class Policy(enum.IntEnum):
    """kvp_policy; parse() takes the names kvp_policy_name gives."""
    KVPLANE_COST = lib.KVP_POLICY_KVPLANE_COST
    ROUND_ROBIN = lib.KVP_POLICY_ROUND_ROBIN
    LEAST_LOADED = lib.KVP_POLICY_LEAST_LOADED
    PREFIX_GREEDY = lib.KVP_POLICY_PREFIX_GREEDY
    SGLANG = lib.KVP_POLICY_SGLANG
    LLMD = lib.KVP_POLICY_LLMD
    DYNAMO = lib.KVP_POLICY_DYNAMO

    @classmethod
    def parse(cls, name: str) -> "Policy":
        out = ffi.new("kvp_policy *")
        check(lib.kvp_policy_parse(name.encode(), out), f"policy {name!r}")
        return cls(out[0])

    @property
    def label(self) -> str:
        return _s(lib.kvp_policy_name(self))

    @property
    def compares_matches(self) -> bool:
        """kvp_policy_compares_matches: False for round_robin and
        least_loaded, which choose on load and read only the chosen
        worker's match (Router.route(chosen_match=...))."""
        return bool(lib.kvp_policy_compares_matches(self))


# kvp_reason, in enum order (router/route_receipt.c spells them so in
# receipts; tests check every decision's against its receipt).
REASONS = ("cost", "affinity", "guard", "tie", "only", "round_robin",
           "least_loaded", "prefix", "score", "sampled")
assert len(REASONS) == lib.KVP_REASON_COUNT_


@dataclass
class ModelSpec:
    """The served model (zero = Llama-3.1-8B defaults)."""
    layers: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    dtype_bytes: int = 0
    params: float = 0.0

    def _fill(self, m: Any) -> None:
        for k in ("layers", "heads", "kv_heads", "head_dim", "dtype_bytes", "params"):
            setattr(m, k, getattr(self, k))

    def kv_bytes_per_token(self) -> float:
        m = ffi.new("kvp_model_spec *")
        self._fill(m)
        return float(lib.kvp_model_kv_bytes_per_token(m))


@dataclass
class GpuSpec:
    """The GPU (zero = H100 SXM defaults); tier lists indexed by Tier."""
    flops: float = 0.0
    efficiency: float = 0.0
    bw: Sequence[float] = (0.0, 0.0, 0.0, 0.0)
    latency_s: Sequence[float] = (0.0, 0.0, 0.0, 0.0)

    def _fill(self, g: Any) -> None:
        g.flops, g.efficiency = self.flops, self.efficiency
        for t in range(TIER_COUNT):
            g.bw[t], g.latency_s[t] = self.bw[t], self.latency_s[t]


@dataclass
class WorkerLoad:
    """A worker's load as the engine reports it (kvp_worker_load)."""
    queued_requests: int = 0
    running_requests: int = 0
    prefill_tokens: int = 0
    decode_blocks: int = 0
    kv_util: float = 0.0
    offline: bool = False


@dataclass
class WorkerMatch:
    """What one worker holds of a request's chain, blocks per tier."""
    worker: int
    blocks: Dict[TierLike, int]
    uncertain: bool = False


@dataclass
class Candidate:
    worker: int
    flags: int
    matched_tokens: int
    reused_tokens: int
    queue_s: float
    recompute_s: float
    load_s: float
    total_s: float
    score: float


@dataclass
class Decision:
    """A routing decision (kvp_decision).  ``receipt()`` /
    ``receipt_json()`` give the receipt (kvp_router_receipt_json) with the
    string ids the request was routed with."""
    worker: int
    policy: Policy
    reason: str
    reason_text: str
    flags: int
    n_eligible: int
    block_size: int
    request_id: int
    session_id: int
    tenant_id: int
    prompt_tokens: int
    hashed_tokens: int
    uncached_tokens: int
    avoided_tokens: int
    avoided_flops: float
    avoided_s: float
    load_s: float
    matched_tokens: Dict[Tier, int]
    reused_tier_tokens: Dict[Tier, int]
    matched_elsewhere_tokens: int
    reused_class_tokens: Dict[StabilityClass, int]
    load_bytes: Dict[Tier, int]
    top: List[Candidate]
    tenant: Optional[str] = None
    session: Optional[str] = None
    request: Optional[str] = None
    _c: Any = field(default=None, repr=False, compare=False)

    def _names(self, unix_time_ns: int, keep: list) -> Any:
        n = ffi.new("kvp_route_names *")
        n.tenant = cstr(self.tenant, keep)
        n.session = cstr(self.session, keep)
        n.request_id = cstr(self.request, keep)
        n.unix_time_ns = unix_time_ns
        return n

    def receipt_json(self, unix_time_ns: int = 0) -> str:
        """The receipt, one JSON object (kvp_router_receipt_json)."""
        keep: list = []
        names = self._names(unix_time_ns, keep)
        need = check(lib.kvp_router_receipt_json(self._c, names, ffi.NULL, 0),
                     "Decision.receipt_json")
        buf = ffi.new("char[]", need + 1)
        check(lib.kvp_router_receipt_json(self._c, names, buf, need + 1),
              "Decision.receipt_json")
        return ffi.string(buf).decode()

    def receipt(self, unix_time_ns: int = 0) -> Dict[str, Any]:
        """The receipt as a dict."""
        return json.loads(self.receipt_json(unix_time_ns))


def _per_tier(a: Any) -> Dict[Tier, int]:
    return {Tier(t): int(a[t]) for t in range(TIER_COUNT)}


def _decision(d: Any, tenant: Optional[str], session: Optional[str],
              request: Optional[str]) -> Decision:
    top = [Candidate(int(c.worker), int(c.flags), int(c.matched_tokens),
                     int(c.reused_tokens), c.queue_s, c.recompute_s, c.load_s,
                     c.total_s, c.score) for c in (d.top[i] for i in range(d.n_top))]
    return Decision(
        int(d.worker), Policy(d.policy), REASONS[d.reason],
        ffi.string(d.reason_text).decode(), int(d.flags), int(d.n_eligible),
        int(d.block_size), int(d.request_id), int(d.session_id), int(d.tenant),
        int(d.prompt_tokens), int(d.hashed_tokens), int(d.uncached_tokens),
        int(d.avoided_tokens), d.avoided_flops, d.avoided_s, d.load_s,
        _per_tier(d.matched_tokens), _per_tier(d.reused_tier_tokens),
        int(d.matched_elsewhere_tokens),
        {StabilityClass(c): int(d.reused_class_tokens[c]) for c in range(CLASS_COUNT)},
        _per_tier(d.load_bytes), top, tenant, session, request, _c=d)


_KNOBS = ("guard", "guard_ref", "guard_min_load", "affinity_eps_rel",
          "affinity_eps_s", "tie_rel", "uncertain_confidence",
          "dynamo_temperature", "llmd_w_prefix", "llmd_w_kv", "llmd_w_queue",
          "max_inflight", "max_sessions", "max_blocks", "replica_id", "seed")


class Router:
    """kvp_router over ``n_workers`` workers; ``block_size`` (required) is
    the hasher's.  Extra keyword options are kvp_router_opts fields:
    guard, guard_ref, guard_min_load, affinity_eps_rel, affinity_eps_s,
    tie_rel, uncertain_confidence, dynamo_temperature, llmd_w_prefix,
    llmd_w_kv, llmd_w_queue, max_inflight, max_sessions, max_blocks,
    replica_id, seed."""

    def __init__(self, n_workers: int, block_size: int,
                 policy: Union[Policy, str] = Policy.KVPLANE_COST,
                 model: Optional[ModelSpec] = None, gpu: Optional[GpuSpec] = None,
                 record_routed: bool = False, **knobs: Any) -> None:
        o = ffi.new("kvp_router_opts *")
        o.policy = Policy.parse(policy) if isinstance(policy, str) else policy
        o.n_workers, o.block_size = n_workers, block_size
        o.record_routed = int(record_routed)
        (model or ModelSpec())._fill(o.model)
        (gpu or GpuSpec())._fill(o.gpu)
        for k, v in knobs.items():
            if k not in _KNOBS:
                raise TypeError(f"Router: unknown option {k!r}")
            setattr(o, k, v)
        out = ffi.new("kvp_router **")
        check(lib.kvp_router_create(o, ffi.NULL, out), "Router")
        self._r = ffi.gc(out[0], lib.kvp_router_destroy)
        self.n_workers, self.block_size = n_workers, block_size

    def set_load(self, worker: int, load: WorkerLoad) -> None:
        c = ffi.new("kvp_worker_load *")
        for k in ("queued_requests", "running_requests", "prefill_tokens",
                  "decode_blocks", "kv_util"):
            setattr(c, k, getattr(load, k))
        c.flags = lib.KVP_WORKER_OFFLINE if load.offline else 0
        check(lib.kvp_router_set_load(self._r, worker, c), f"Router.set_load({worker})")

    def report_bandwidth(self, tier: TierLike, bytes_per_s: float) -> None:
        """A measured bandwidth (thread-safe)."""
        check(lib.kvp_router_report_bandwidth(self._r, tier_of(tier), bytes_per_s),
              "Router.report_bandwidth")

    def bandwidth(self, tier: TierLike) -> float:
        return float(lib.kvp_router_bandwidth(self._r, tier_of(tier)))

    def route(self, keys: KeysLike, index: Optional[Index] = None,
              matches: Optional[Sequence[WorkerMatch]] = None,
              prompt_tokens: int = 0, session: Optional[str] = None,
              request: Optional[str] = None, tenant: Optional[str] = None,
              cls: Optional[Classification] = None,
              now_ns: Optional[int] = None,
              chosen_match: Optional[Callable[[int], Optional[WorkerMatch]]] = None
              ) -> Decision:
        """Route one request: per-worker matches from ``index`` (its query at
        ``now_ns``) or given as ``matches``; or, for a policy that chooses on
        load alone (``Policy.compares_matches`` False), ``chosen_match(worker)``
        gives the chosen worker's match only, asked for after the choice
        (kvp_router_route_chosen: the others' matches then go unquoted, flag
        KVP_DECISION_CHOSEN_ONLY; None: it holds nothing).  An exception it
        raises is re-raised here and nothing is routed.  Ids are the caller's
        strings; the router gets their kvp_id64 (request None: the router
        assigns one).  Raises on failure (e.g. StateError: every worker
        offline; KvplaneError KVP_ENOTSUP: chosen_match with a policy that
        compares matches)."""
        if chosen_match is not None and (index is not None or matches):
            raise TypeError("Router.route: chosen_match excludes index and matches")
        k = as_keys(keys)
        q = ffi.new("kvp_route_request *")
        q.keys, q.n_blocks, q.prompt_tokens = k.ptr, len(k), prompt_tokens
        q.cls = ffi.NULL if cls is None else cls._c
        q.session_id, q.request_id, q.tenant = id64(session), id64(request), id64(tenant)
        q.block_size = self.block_size
        d = ffi.new("kvp_decision *")
        if chosen_match is not None:
            st = [chosen_match, None]
            h = ffi.new_handle(st)
            rc = lib.kvp_router_route_chosen(self._r, q, lib.kvp_py_chosen_match, h, d)
            if st[1] is not None:
                raise st[1]
        elif index is not None:
            now = lib.kvp_now_ns() if now_ns is None else now_ns
            rc = lib.kvp_router_route(self._r, index._ix, q, now, d)
        else:
            m, nm = _matches(matches or ())
            rc = lib.kvp_router_route_matches(self._r, q, m, nm, d)
        check(rc, "Router.route")
        return _decision(d, tenant, session, request)

    def complete(self, decision: Decision) -> None:
        """The request finished its prefill (or was cancelled)."""
        check(lib.kvp_router_complete(self._r, decision.worker, decision.request_id),
              "Router.complete")

    def inflight(self, worker: int) -> Dict[str, float]:
        r, t, s = ffi.new("uint64_t *"), ffi.new("uint64_t *"), ffi.new("double *")
        check(lib.kvp_router_inflight(self._r, worker, r, t, s), "Router.inflight")
        return {"requests": int(r[0]), "tokens": int(t[0]), "seconds": float(s[0])}

    def close(self) -> None:
        if self._r is not None:
            ffi.release(self._r)
            self._r = None

    def __enter__(self) -> "Router":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# Flags no match may carry: the router refuses the decision (KVP_EINVAL) and
# records nothing, so an exception in chosen_match routes nothing.
_REFUSE = 0x80000000


@ffi.def_extern()
def kvp_py_chosen_match(opaque: Any, worker: int, out: Any) -> int:
    st = ffi.from_handle(opaque)
    try:
        m = st[0](int(worker))
        if m is not None:
            out.flags = lib.KVP_MATCH_UNCERTAIN if m.uncertain else 0
            for t, n in m.blocks.items():
                out.blocks[tier_of(t)] = n
    except BaseException as exc:  # never unwind into C; re-raised by route()
        st[1] = exc
        out.flags = _REFUSE
    return 0


def _matches(ms: Sequence[WorkerMatch]) -> tuple:
    if not ms:
        return ffi.NULL, 0
    arr = ffi.new("kvp_worker_match[]", len(ms))
    for i, m in enumerate(ms):
        arr[i].worker = m.worker
        arr[i].flags = lib.KVP_MATCH_UNCERTAIN if m.uncertain else 0
        for t, n in m.blocks.items():
            arr[i].blocks[tier_of(t)] = n
    return arr, len(ms)
