# SPDX-License-Identifier: Apache-2.0
"""kvplane: where LLM KV-cache state lives and which worker serves the next
turn -- Python bindings over libkvplane (cffi, API mode).

Every call into C releases the GIL (cffi API mode does so for every
function), so hashing, index queries and tier I/O run in parallel with
other Python threads; each object keeps the C API's thread rules (see each
class).  Errors raise KvplaneError (code, name, message).  Objects free
their handles when collected; close() / ``with`` frees them at once.
"""
from __future__ import annotations

try:
    from ._kvplane import ffi as _ffi, lib as _lib
except ImportError as _e:  # pragma: no cover - depends on the build
    if "static TLS" in str(_e):
        raise ImportError(
            f"{_e}\nthis build of kvplane's extension links a library with "
            "initial-exec TLS, which a running process cannot load; kvplane "
            "itself links none (test_python_wheel checks), so the extension "
            "was linked against a different library set: docs/python.md, "
            "\"Loading into any process\".") from _e
    raise

from ._util import (InvalidArgumentError, Key, KvplaneError, Keys, NoSpaceError,
                    NotFoundError, StabilityClass, StateError, Tier, err_name,
                    id64, strerror)
from .events import EventSource, EventsSubscriber
from .index import Index, IndexStats, Match
from .ledger import Ledger, MissCause, Record, Totals, explain, receipt_json
from .prefix import (Chain, Classification, DriftReport, Extras, HashAlgo, Hasher,
                     MMSpan, Namespace, Role, SegmentMark, Stability, Turn,
                     VllmCompat, drift_compare)
from .router import (Candidate, Decision, GpuSpec, ModelSpec, Policy, Router,
                     WorkerLoad, WorkerMatch)
from .tier import Resident, TierEvent, TierStats, TierStore
from .device import (Device, KvLayout, LayoutInfo, Stream, TierLink, TierLinkStats,
                     backend_available, vllm_kv_layout)

__version__ = _ffi.string(_lib.kvp_version()).decode()


def now_ns() -> int:
    """kvp_now_ns: the monotonic clock the index and router use."""
    return int(_lib.kvp_now_ns())


_PY_LEVELS = {1: 40, 2: 30, 3: 20, 4: 10, 5: 5}


@_ffi.def_extern()
def kvp_py_log_sink(opaque, level, module, msg):  # type: ignore[no-untyped-def]
    import logging
    name = _ffi.string(module).decode("utf-8", "replace") if module else "kvplane"
    logging.getLogger(f"kvplane.{name}").log(
        _PY_LEVELS.get(int(level), 10), _ffi.string(msg).decode("utf-8", "replace"))


def log_to_python(enable: bool = True) -> None:
    """Send the library's log lines to the ``logging`` module (loggers
    ``kvplane.<module>``) instead of stderr; False restores stderr.  Set it
    once at start-up (kvp_log_set_sink is not synchronised with logging
    threads); the lines still pass the library's level first."""
    if enable:
        _lib.kvp_log_set_sink(_lib.kvp_py_log_sink, _ffi.NULL)
    else:
        _lib.kvp_log_set_sink(_ffi.NULL, _ffi.NULL)


def get_log_level() -> int:
    """The library's current log level (kvp_log_get_level)."""
    return int(_lib.kvp_log_get_level())


def set_log_level(level: int) -> None:
    """Library log level: 0 off, 1 error, 2 warn (default), 3 info,
    4 debug, 5 trace (kvp_log_set_level; KVP_LOG in the environment)."""
    _lib.kvp_log_set_level(level)


__all__ = [
    "KvplaneError", "InvalidArgumentError", "NotFoundError", "StateError",
    "NoSpaceError", "strerror", "err_name", "id64", "now_ns", "set_log_level",
    "log_to_python", "get_log_level",
    "Tier", "StabilityClass", "Key", "Keys",
    "Namespace", "HashAlgo", "VllmCompat", "Extras", "MMSpan", "Hasher", "Chain",
    "Role", "SegmentMark", "Stability", "Classification", "Turn", "DriftReport",
    "drift_compare",
    "Index", "Match", "IndexStats",
    "Router", "Policy", "ModelSpec", "GpuSpec", "WorkerLoad", "WorkerMatch",
    "Decision", "Candidate",
    "Ledger", "Record", "Totals", "MissCause", "explain", "receipt_json",
    "TierStore", "TierEvent", "TierStats", "Resident",
    "EventsSubscriber", "EventSource",
    "Device", "Stream", "KvLayout", "LayoutInfo", "vllm_kv_layout", "TierLink", "TierLinkStats",
    "backend_available",
]
