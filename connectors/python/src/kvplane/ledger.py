# SPDX-License-Identifier: Apache-2.0
"""The reuse ledger (include/kvplane/ledger.h): prefill avoided per request,
session and tenant, and why the rest missed; Prometheus text and JSON lines.
Every Ledger method may be called from any thread (the C ledger locks)."""
from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

from ._kvplane import ffi, lib
from ._util import (CLASS_COUNT, TIER_COUNT, StabilityClass, Tier, _s, check,
                    cstr, error)
from .router import Decision


class MissCause(enum.IntEnum):
    NEVER_SEEN = lib.KVP_MISS_NEVER_SEEN
    EVICTED = lib.KVP_MISS_EVICTED
    OTHER_WORKER = lib.KVP_MISS_OTHER_WORKER
    PARTIAL_BLOCK = lib.KVP_MISS_PARTIAL_BLOCK
    NAMESPACE = lib.KVP_MISS_NAMESPACE
    DRIFT = lib.KVP_MISS_DRIFT
    NOT_WORTH_LOADING = lib.KVP_MISS_NOT_WORTH_LOADING
    UNKNOWN = lib.KVP_MISS_UNKNOWN

    @property
    def label(self) -> str:
        return _s(lib.kvp_miss_cause_name(self))


MISS_COUNT = lib.KVP_MISS_COUNT_


@dataclass
class Record:
    """One request's outcome (kvp_ledger_record); dict fields are keyed by
    Tier / StabilityClass / MissCause (absent = 0)."""
    prompt_tokens: int
    reused_tokens: int = 0
    recomputed_tokens: int = 0
    tenant: Optional[str] = None
    session: Optional[str] = None
    request_id: Optional[str] = None
    worker: int = -1
    unix_time_ns: int = 0
    reused_by_tier: Dict[Tier, int] = field(default_factory=dict)
    prompt_by_class: Dict[StabilityClass, int] = field(default_factory=dict)
    reused_by_class: Dict[StabilityClass, int] = field(default_factory=dict)
    miss_tokens: Dict[MissCause, int] = field(default_factory=dict)
    load_bytes: Dict[Tier, int] = field(default_factory=dict)
    avoided_flops: float = 0.0
    avoided_gpu_seconds: float = 0.0

    def _c(self, keep: list) -> Any:
        r = ffi.new("kvp_ledger_record *")
        r.tenant, r.session = cstr(self.tenant, keep), cstr(self.session, keep)
        r.request_id = cstr(self.request_id, keep)
        for k in ("worker", "unix_time_ns", "prompt_tokens", "reused_tokens",
                  "recomputed_tokens", "avoided_flops", "avoided_gpu_seconds"):
            setattr(r, k, getattr(self, k))
        for k in ("reused_by_tier", "prompt_by_class", "reused_by_class",
                  "miss_tokens", "load_bytes"):
            arr = getattr(r, k)
            for i, v in getattr(self, k).items():
                arr[int(i)] = v
        return r


@dataclass
class Totals:
    """Sums over accepted records (kvp_ledger_totals)."""
    requests: int
    prompt_tokens: int
    reused_tokens: int
    recomputed_tokens: int
    reused_by_tier: Dict[Tier, int]
    prompt_by_class: Dict[StabilityClass, int]
    reused_by_class: Dict[StabilityClass, int]
    miss_tokens: Dict[MissCause, int]
    load_bytes: Dict[Tier, int]
    avoided_flops: float
    avoided_gpu_seconds: float

    def hit_rate(self, c: StabilityClass) -> float:
        """reused / prompt tokens of class c (NaN when none)."""
        p = self.prompt_by_class[StabilityClass(c)]
        return self.reused_by_class[StabilityClass(c)] / p if p else float("nan")


def _totals(t: Any) -> Totals:
    def arr(a: Any, enum_: Any, n: int) -> Dict:
        return {enum_(i): int(a[i]) for i in range(n)}
    return Totals(int(t.requests), int(t.prompt_tokens), int(t.reused_tokens),
                  int(t.recomputed_tokens), arr(t.reused_by_tier, Tier, TIER_COUNT),
                  arr(t.prompt_by_class, StabilityClass, CLASS_COUNT),
                  arr(t.reused_by_class, StabilityClass, CLASS_COUNT),
                  arr(t.miss_tokens, MissCause, MISS_COUNT),
                  arr(t.load_bytes, Tier, TIER_COUNT), t.avoided_flops,
                  t.avoided_gpu_seconds)


@ffi.def_extern()
def kvp_py_write(opaque: Any, data: Any, n: int) -> int:
    ffi.from_handle(opaque).append(ffi.unpack(data, n))
    return 0


def explain(record: Record) -> str:
    """Which rule a record breaks, in words ("ok" for a valid record)."""
    keep: list = []
    buf = ffi.new("char[1024]")
    lib.kvp_ledger_explain(record._c(keep), buf, 1024)
    return ffi.string(buf).decode()


def receipt_json(record: Record) -> str:
    """The JSON-lines receipt of a record (kvp_ledger_receipt_json)."""
    keep: list = []
    r = record._c(keep)
    need = check(lib.kvp_ledger_receipt_json(r, ffi.NULL, 0), "receipt_json")
    buf = ffi.new("char[]", need + 1)
    lib.kvp_ledger_receipt_json(r, buf, need + 1)
    return ffi.string(buf).decode()


class Ledger:
    """kvp_ledger: bounded per-session and per-tenant totals."""

    def __init__(self, max_sessions: int = 0, max_tenants: int = 0) -> None:
        o = ffi.new("kvp_ledger_opts *")
        o.max_sessions, o.max_tenants = max_sessions, max_tenants
        out = ffi.new("kvp_ledger **")
        check(lib.kvp_ledger_create(o, ffi.NULL, out), "Ledger")
        self._l = ffi.gc(out[0], lib.kvp_ledger_destroy)

    def add(self, record: Record) -> None:
        """Record one request; an inconsistent record raises
        InvalidArgumentError whose message says which rule broke."""
        keep: list = []
        rc = lib.kvp_ledger_add(self._l, record._c(keep))
        if rc < 0:
            raise error(rc, f"Ledger.add: {explain(record)}")

    def add_decision(self, d: Decision, unix_time_ns: int = 0) -> None:
        """Record a routing decision under the ids it was routed with."""
        keep: list = []
        check(lib.kvp_ledger_add_decision(self._l, d._c, d._names(unix_time_ns, keep)),
              "Ledger.add_decision")

    def totals(self, tenant: Optional[str] = None,
               session: Optional[str] = None) -> Totals:
        """Global totals, a tenant's, or a (tenant, session)'s; NotFoundError
        when never seen or evicted."""
        t = ffi.new("kvp_ledger_totals *")
        keep: list = []
        if session is not None:
            rc = lib.kvp_ledger_session_totals(self._l, cstr(tenant, keep),
                                               cstr(session, keep), t)
        elif tenant is not None:
            rc = lib.kvp_ledger_tenant_totals(self._l, cstr(tenant, keep), t)
        else:
            rc = lib.kvp_ledger_global_totals(self._l, t)
        check(rc, "Ledger.totals")
        return _totals(t)

    def stats(self) -> Dict[str, int]:
        s = ffi.new("kvp_ledger_stats *")
        check(lib.kvp_ledger_stats_get(self._l, s), "Ledger.stats")
        return {k: int(getattr(s, k)) for k in (
            "rejected_total", "alloc_failures", "sessions", "tenants",
            "session_evictions", "tenant_evictions")}

    def prometheus(self) -> str:
        """Prometheus text exposition 0.0.4 (global + per tenant)."""
        need = ffi.new("size_t *")
        cap = 16384
        while True:
            buf = ffi.new("char[]", cap)
            rc = lib.kvp_ledger_prometheus(self._l, buf, cap, need)
            if rc != lib.KVP_ENOSPC:
                check(rc, "Ledger.prometheus")
                return ffi.string(buf).decode()
            cap = int(need[0]) * 2 + 1024

    def json_lines(self, scopes: Iterable[str] = ("global", "tenants", "sessions")) -> str:
        """JSON lines: global totals, every tenant, every session."""
        bits = {"global": lib.KVP_LEDGER_JSON_GLOBAL,
                "tenants": lib.KVP_LEDGER_JSON_TENANTS,
                "sessions": lib.KVP_LEDGER_JSON_SESSIONS}
        what = 0
        for s in scopes:
            what |= bits[s]
        chunks: List[bytes] = []
        h = ffi.new_handle(chunks)
        check(lib.kvp_ledger_json_write(self._l, what, lib.kvp_py_write, h),
              "Ledger.json_lines")
        return b"".join(chunks).decode()

    def json(self, scopes: Iterable[str] = ("global", "tenants", "sessions")) -> List[dict]:
        return [json.loads(line) for line in self.json_lines(scopes).splitlines() if line]

    def close(self) -> None:
        if self._l is not None:
            ffi.release(self._l)
            self._l = None

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
