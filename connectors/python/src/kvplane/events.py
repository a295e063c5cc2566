# SPDX-License-Identifier: Apache-2.0
"""The vLLM KV-event subscriber (include/kvplane/events.h, libkvplane-events):
ZeroMQ streams of engines' KV events applied to an Index."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

from ._kvplane import ffi, lib
from ._util import check, cstr
from .index import Index
from .prefix import HashAlgo, Namespace, VllmCompat


@dataclass
class EventSource:
    """One engine's event stream.  ``rekey`` (default): blocks are re-keyed
    into kvplane keys of ``ns`` (a native algorithm, the events' block
    size); rekey=False indexes the engine's own hashes."""
    endpoint: str
    worker: int
    replay_endpoint: Optional[str] = None
    topic: Optional[str] = None
    stream: int = 0
    dp_rank: int = 0
    connect: str = "auto"  # auto | connect | bind
    rekey: bool = True
    ns: Optional[Namespace] = None
    algo: HashAlgo = HashAlgo.XXH3_128
    python_hash_seed: Optional[str] = None
    vllm_compat: VllmCompat = VllmCompat.LATEST


_CONNECT = {"auto": lib.KVP_EVENTS_AUTO, "connect": lib.KVP_EVENTS_CONNECT,
            "bind": lib.KVP_EVENTS_BIND}

STAT_NAMES = ("batches", "events", "blocks_stored", "blocks_removed", "clears",
              "gaps", "decode_errors", "restarts", "lag_seconds")


class EventsSubscriber:
    """kvp_events feeding ``index`` (which must outlive it; the sources'
    workers must be added first).  Either start() the I/O thread or call
    poll() from your own loop."""

    def __init__(self, index: Index, sources: Sequence[EventSource],
                 replay_timeout_ms: int = 0, no_initial_replay: bool = False) -> None:
        self._ev = None
        self._keep: List[Any] = []
        srcs = ffi.new("kvp_events_source[]", len(sources))
        for i, s in enumerate(sources):
            c = srcs[i]
            c.endpoint = cstr(s.endpoint, self._keep)
            c.replay_endpoint = cstr(s.replay_endpoint, self._keep)
            c.topic = cstr(s.topic, self._keep)
            c.worker, c.stream, c.dp_rank = s.worker, s.stream, s.dp_rank
            c.connect = _CONNECT[s.connect]
            c.keying = lib.KVP_EVENTS_REKEY if s.rekey else lib.KVP_EVENTS_ENGINE_HASH
            c.ns = s.ns._ns if s.ns is not None else ffi.NULL
            c.hasher.algo, c.hasher.vllm_compat = s.algo, s.vllm_compat
            c.hasher.python_hash_seed = cstr(s.python_hash_seed, self._keep)
        o = ffi.new("kvp_events_opts *")
        o.replay_timeout_ms, o.no_initial_replay = replay_timeout_ms, int(no_initial_replay)
        out = ffi.new("kvp_events **")
        check(lib.kvp_events_create(index._ix, srcs, len(sources), o, ffi.NULL, out),
              "EventsSubscriber")
        self._ev = out[0]
        self.index = index  # borrowed by the C subscriber: keep it alive
        self.n_sources = len(sources)

    def start(self) -> None:
        """Run the I/O thread."""
        check(lib.kvp_events_start(self._ev), "EventsSubscriber.start")

    def stop(self) -> None:
        check(lib.kvp_events_stop(self._ev), "EventsSubscriber.stop")

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply what has arrived (waiting up to timeout_ms, -1 = forever);
        returns the number of batches applied."""
        return check(lib.kvp_events_poll(self._ev, timeout_ms), "EventsSubscriber.poll")

    def stats(self, source: Optional[int] = None) -> dict:
        s = ffi.new("kvp_events_stats *")
        src = 0xFFFFFFFF if source is None else source
        check(lib.kvp_events_stats_get(self._ev, src, s), "EventsSubscriber.stats")
        return {k: getattr(s, k) for k in STAT_NAMES}

    def prometheus(self) -> str:
        need = check(lib.kvp_events_prometheus(self._ev, ffi.NULL, 0), "prometheus")
        buf = ffi.new("char[]", need + 1)
        lib.kvp_events_prometheus(self._ev, buf, need + 1)
        return ffi.string(buf).decode()

    def close(self) -> None:
        """Stop the I/O thread and close the sockets.  Idempotent."""
        if self._ev is not None:
            lib.kvp_events_destroy(self._ev)
            self._ev = None

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "EventsSubscriber":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
