# SPDX-License-Identifier: Apache-2.0
"""kvtier as vLLM's KV connector (vLLM v1, ``KVConnectorBase_V1``).

Turn it on with::

    --kv-transfer-config '{"kv_connector": "KvtierConnector",
      "kv_connector_module_path": "kvplane.vllm", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"config": "/etc/kvplane/kvtier.yaml"}}'

``config`` is a kvplane YAML file; its ``tiers:`` section sizes the store
(docs/config.md; ``nvme_dir`` adds the NVMe tier that survives a restart).
Other extra-config keys: ``durable`` (default true: every saved block is
written through to the NVMe slab files and fdatasynced before the step
returns, so a restart finds it; false: DRAM only, NVMe by demotion),
``stats_file`` (a JSON file rewritten whenever the counters change) and
``model_id`` (the namespace's model name; default vLLM's ``--model``) and
``pd_dir`` (prefill/decode disaggregation: a directory both instances of a
P/D pair can read, see below).

What it does, per request:

* scheduler side, ``get_num_new_matched_tokens``: the prompt's full blocks
  are keyed by vLLM's own block hashes, computed by kvplane
  (``Hasher(VLLM_SHA256 / VLLM_XXHASH)``, the engine's PYTHONHASHSEED) and
  checked against ``request.block_hashes`` (a mismatch is a counted miss:
  a wrong key is never used).  The longest prefix resident in kvtier beyond
  vLLM's own hit is offered; a block only on NVMe is read (and verified:
  slot header, key, namespace, payload XXH3-64) into DRAM before it is
  offered, so a corrupt or missing slab slot is a counted miss here and vLLM
  computes the block itself.  The last prompt token is never offered (vLLM
  must compute one token).
* worker side: ``start_load_kv`` scatters the offered blocks into vLLM's
  paged KV cache with ``kvplane.TierLink`` (kvplane's device layer: the CPU
  backend here, CUDA where the cache is on a GPU); a block that fails even
  then is reported by ``get_block_ids_with_load_errors`` (vLLM recomputes it
  with ``kv_load_failure_policy: recompute``).  ``wait_for_save`` gathers
  every prompt block completed in the step into kvtier (DRAM, and NVMe
  when ``durable``).  Loads and saves are synchronous, once per step, not
  per layer.

The store lives in the worker process (where the KV cache is); the
scheduler (vLLM's EngineCore process) asks it over a Unix socket, one JSON
line each way (as LMCache's lookup server): a worker that cannot be asked
is a miss, logged once.

P/D (``pd_dir``): on a prefill instance (``kv_role`` ``kv_producer`` or
``kv_both``) a request with ``kv_transfer_params.do_remote_decode`` has every
full prompt block saved into kvtier and *handed off*: written to
``pd_dir/<model tag>/<key>.kvb`` (a header naming the key, the KV layout and a
BLAKE2b digest of the payload; written to a temporary name and renamed, so a
reader sees a whole file or none; fsynced when ``durable``) before the step
returns, so before the response.  ``request_finished`` then returns
``kv_transfer_params`` in the NIXL connector's shape (``do_remote_prefill``,
``remote_engine_id``, ``remote_block_ids``: the handed-off blocks,
``remote_host`` / ``remote_port``: this instance, no channel is opened) plus
``kvplane_handoff_blocks``.  On a decode instance (``kv_consumer`` or
``kv_both``) a block its kvtier lacks is looked up in ``pd_dir`` by vLLM's
own block hash when the scheduler asks (so blocks written by another process
after this one started are found), verified (key, layout, length, digest) and
put into its kvtier, then offered and loaded as any kvtier hit.  A missing
or corrupt hand-off file is a counted miss (``pd_import_missing``,
``pd_import_corrupt``) and vLLM computes the block; never wrong KV.  Each
block is one file: kvtier's NVMe slab files are single-process (one store
owns its slots), so two instances cannot share one ``nvme_dir``.  A
``kv_consumer`` saves nothing into kvtier (its blocks came from the prefill).

Limits (checked, with a clear error or a counted miss, never wrong KV):
world size 1 (one worker per engine: no tensor/pipeline parallel yet); one
KV cache group of full attention whose blocks are contiguous per layer;
prompts with multimodal inputs or prompt embeddings are not offered
(counted ``unsupported``); prompt blocks only (generated tokens are not
saved).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from . import (Device, Extras, HashAlgo, Hasher, Key, KvplaneError, Namespace, Tier,
               TierLink, TierStore, vllm_kv_layout)

log = logging.getLogger("kvplane.vllm")

__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "read_options"]

_ALGOS = {"sha256": HashAlgo.VLLM_SHA256, "xxhash": HashAlgo.VLLM_XXHASH}


# ---- options --------------------------------------------------------------------
@dataclass
class Options:
    yaml: str
    config_path: str
    durable: bool = True
    stats_file: Optional[str] = None
    model_id: Optional[str] = None
    pd_dir: Optional[str] = None


def read_options(extra: Dict[str, Any]) -> Options:
    """kv_connector_extra_config -> Options; a bad value raises ValueError
    naming the key (the engine then refuses to start: a config error is
    never a silent miss)."""
    known = {"config", "durable", "stats_file", "model_id", "pd_dir"}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ValueError(f"kvplane.vllm: kv_connector_extra_config: unknown key(s) "
                         f"{unknown}; known: {sorted(known)}")
    path = extra.get("config")
    if not isinstance(path, str) or not path:
        raise ValueError("kvplane.vllm: kv_connector_extra_config.config must name "
                         "a kvplane YAML file (its tiers: section configures kvtier)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"kvplane.vllm: kv_connector_extra_config.config: "
                         f"cannot read {path}: {e.strerror}") from e
    durable = extra.get("durable", True)
    if not isinstance(durable, bool):
        raise ValueError("kvplane.vllm: kv_connector_extra_config.durable must be "
                         f"true or false, got {durable!r}")
    stats = extra.get("stats_file")
    if stats is not None and not isinstance(stats, str):
        raise ValueError("kvplane.vllm: kv_connector_extra_config.stats_file must "
                         "be a path")
    model = extra.get("model_id")
    if model is not None and not isinstance(model, str):
        raise ValueError("kvplane.vllm: kv_connector_extra_config.model_id must be "
                         "a string")
    pd = extra.get("pd_dir")
    if pd is not None and (not isinstance(pd, str) or not pd):
        raise ValueError("kvplane.vllm: kv_connector_extra_config.pd_dir must be "
                         "a directory path")
    if pd is not None:
        try:
            os.makedirs(pd, exist_ok=True)
        except OSError as e:
            raise ValueError(f"kvplane.vllm: kv_connector_extra_config.pd_dir: "
                             f"cannot create {pd}: {e.strerror}") from e
    return Options(text, path, durable, stats, model, pd)


# ---- the worker's store and its counters ---------------------------------------
COUNTERS = (
    "lookups",            # residency questions answered for the scheduler
    "lookup_hit_blocks",  # blocks offered to vLLM
    "lookup_dram_blocks",  # ... of them resident in DRAM when asked
    "lookup_nvme_blocks",  # ... read back from NVMe (verified) when asked
    "verify_failed",      # NVMe blocks that failed their checks: a miss
    "hash_mismatch",      # kvplane's keys differed from request.block_hashes
    "unsupported",        # requests not offered (multimodal, prompt embeds)
    "loads", "blocks_loaded", "load_failed_blocks",
    "saves", "blocks_saved", "save_failed_blocks", "blocks_save_skipped",
    "blocks_replaced",    # suspect NVMe blocks vLLM recomputed: rewritten
    "lookup_ns", "load_ns", "save_ns",  # time spent (monotonic ns)
    # P/D hand-off (pd_dir)
    "pd_exported_blocks",  # prefill: blocks written to pd_dir
    "pd_export_skipped",   # ... already there (same key, earlier request)
    "pd_export_failed",    # ... not in kvtier / not written: the decode computes
    "pd_imported_blocks",  # decode: blocks read from pd_dir into kvtier
    "pd_import_missing",   # a do_remote_prefill request's block not in pd_dir
    "pd_import_corrupt",   # a hand-off file that failed its checks: a miss
    "pd_ns",
)


# ---- P/D hand-off: one file per block in a directory both instances read ----------
_PD_MAGIC = b"KVPLPD01"
_PD_HDR = struct.Struct("<8sQQQI16s")  # magic, key hi, lo, payload len, layout len, digest


class Handoff:
    """pd_dir/<tag>/<key>.kvb, tag = (model, block size): written whole
    (temporary name, rename), read and verified whole."""

    def __init__(self, root: str, model_id: str, block_size: int, durable: bool) -> None:
        tag = hashlib.sha256(f"{model_id}\0{block_size}".encode()).hexdigest()[:16]
        self.dir = os.path.join(root, tag)
        os.makedirs(self.dir, exist_ok=True)
        self.durable = durable

    def path(self, k: Key) -> str:
        return os.path.join(self.dir, f"{k.hi:016x}{k.lo:016x}.kvb")

    def have(self, k: Key) -> bool:
        return os.path.exists(self.path(k))

    def write(self, k: Key, layout: bytes, payload: Any) -> None:
        mv = memoryview(payload).cast("B")
        dig = hashlib.blake2b(mv, digest_size=16).digest()
        hdr = _PD_HDR.pack(_PD_MAGIC, k.hi, k.lo, len(mv), len(layout), dig) + layout
        final = self.path(k)
        tmp = f"{final}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            os.write(fd, hdr)
            off = 0
            while off < len(mv):
                off += os.write(fd, mv[off:])
            if self.durable:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)

    def read(self, k: Key, layout: bytes, out: memoryview) -> str:
        """'ok' (out holds the block), 'missing' or 'corrupt'."""
        try:
            with open(self.path(k), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return "missing"
        except OSError:
            return "corrupt"
        if len(data) < _PD_HDR.size:
            return "corrupt"
        magic, hi, lo, n, ln, dig = _PD_HDR.unpack_from(data)
        body = memoryview(data)[_PD_HDR.size + ln:]
        if (magic != _PD_MAGIC or hi != k.hi or lo != k.lo or n != len(out)
                or data[_PD_HDR.size:_PD_HDR.size + ln] != layout or len(body) != n
                or hashlib.blake2b(body, digest_size=16).digest() != dig):
            return "corrupt"
        out[:] = body
        return "ok"


class Store:
    """The worker's TierStore, its namespace and the link over vLLM's KV
    cache, with the connector's counters (written to stats_file)."""

    def __init__(self, opts: Options, store: TierStore, ns: Namespace,
                 link: TierLink, block_bytes: int, handoff: Optional[Handoff] = None,
                 layout_id: str = "", consumer: bool = False) -> None:
        self.opts, self.store, self.ns, self.link = opts, store, ns, link
        self.block_bytes = block_bytes
        self.handoff, self.layout = handoff, layout_id.encode()
        self.consumer = consumer  # imports from pd_dir on a miss
        self.xbuf = bytearray(block_bytes)  # hand-off export / import
        self.lock = threading.Lock()
        self.counters = {c: 0 for c in COUNTERS}
        self.dirty = True
        self.scratch = bytearray(0)
        self.suspect: Set[Key] = set()

    def count(self, name: str, n: int = 1) -> None:
        if n:
            with self.lock:
                self.counters[name] += n
                self.dirty = True

    def import_handoff(self, keys: List[Key], remote: bool) -> None:
        """Blocks of the prefix kvtier lacks, read from pd_dir (another
        instance's hand-off) into kvtier; stops at the first missing or bad
        file (counted when the request came from a remote prefill).  Caller
        holds self.lock."""
        t0 = time.monotonic_ns()
        c = self.counters
        mv = memoryview(self.xbuf)
        for k in keys:
            if self.store.contains(self.ns, k) is not None:
                continue
            got = self.handoff.read(k, self.layout, mv)
            if got == "missing":
                c["pd_import_missing"] += int(remote)
                break
            if got == "corrupt":
                c["pd_import_corrupt"] += 1
                break
            self.store.put(self.ns, k, mv)
            c["pd_imported_blocks"] += 1
        c["pd_ns"] += time.monotonic_ns() - t0
        self.dirty = True

    def export_handoff(self, keys: List[Key]) -> None:
        """Writes keys' blocks (a prefix, just saved into kvtier) to pd_dir;
        stops at the first one kvtier cannot give (the decode side computes
        it and the rest)."""
        t0 = time.monotonic_ns()
        mv = memoryview(self.xbuf)
        for k in keys:
            if self.handoff.have(k):
                self.count("pd_export_skipped")
                continue
            with self.lock:
                got = self.store.get_into(self.ns, k, mv)
                if got is not None and got[1] == self.block_bytes:
                    try:
                        self.handoff.write(k, self.layout, mv)
                    except OSError as e:
                        log.warning("kvplane.vllm: pd_dir write %s: %s", self.handoff.dir, e)
                        got = None
            if got is None:
                self.count("pd_export_failed", len(keys) - keys.index(k))
                break
            self.count("pd_exported_blocks")
        self.count("pd_ns", time.monotonic_ns() - t0)

    def lookup(self, keys: List[Key], remote: bool = False) -> Tuple[int, int]:
        """How many of ``keys`` (a prefix) kvtier can give now, and how many
        of those were read back from NVMe.  The blocks are read, BATCH at a
        time, in one store call each (one GIL release per batch, not one per
        key: the worker's own loop holds the GIL between them): an NVMe block
        is verified then (and promoted to DRAM), so a bad slot is a miss now,
        not a failed load later; a DRAM block costs a copy into scratch."""
        t0 = time.monotonic_ns()
        n = nvme = bad = 0
        with self.lock:  # one scratch area
            if self.handoff is not None and self.consumer:
                self.import_handoff(keys, remote)
            for c in range(0, len(keys), self.BATCH):
                ks = keys[c:c + self.BATCH]
                before = self.store.stats().checksum_failures
                got = self._read(ks)
                stop = next((j for j, g in enumerate(got)
                             if g is None or g[1] != self.block_bytes), len(got))
                n += stop
                nvme += sum(1 for g in got[:stop] if g[0] == Tier.NVME)
                if stop < len(got):
                    if self.store.stats().checksum_failures > before:
                        bad = 1
                        # the blocks behind a bad slot will be recomputed; any
                        # of them still on NVMe only is suspect (same file,
                        # same damage?): wait_for_save replaces it
                        if len(self.suspect) > 65536:
                            self.suspect.clear()
                        self.suspect.update(keys[c + stop + 1:])
                    break
            c = self.counters
            c["lookups"] += 1
            c["verify_failed"] += bad
            c["lookup_hit_blocks"] += n
            c["lookup_nvme_blocks"] += nvme
            c["lookup_dram_blocks"] += n - nvme
            c["lookup_ns"] += time.monotonic_ns() - t0
            self.dirty = True
        self.flush()
        return n, nvme

    BATCH = 64  # blocks read per store call (scratch: BATCH blocks)

    def _read(self, ks: List[Key]) -> List[Any]:
        bb = self.block_bytes
        if len(self.scratch) < len(ks) * bb:
            self.scratch = bytearray(self.BATCH * bb)
        mv = memoryview(self.scratch)
        outs = [mv[j * bb:(j + 1) * bb] for j in range(len(ks))]
        try:
            return self.store.get_batch(self.ns, ks, outs)
        except KvplaneError:  # an item's own error: ask one by one
            return [self.store.get_into(self.ns, k, o) for k, o in zip(ks, outs)]

    def snapshot(self) -> Dict[str, Any]:
        with self.lock:
            out: Dict[str, Any] = dict(self.counters)
        out["tier"] = vars(self.store.stats())
        out["link"] = vars(self.link.stats())
        out["nvme_dir"] = self.store.nvme_dir
        out["pid"] = os.getpid()
        out["time"] = time.time()
        return out

    def flush(self) -> None:
        """Rewrites stats_file (atomically) when a counter changed."""
        path = self.opts.stats_file
        if path is None or not self.dirty:
            return
        self.dirty = False
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.snapshot(), f, indent=1, sort_keys=True)
        os.replace(tmp, path)


# ---- scheduler <-> worker: residency over a Unix socket ----------------------------
# vLLM runs the scheduler (EngineCore) and the worker in different processes
# (the CPU build's default executor is multiprocess even for one worker), and
# the store lives where the KV cache is.  As LMCache's lookup server does, the
# worker answers the scheduler's residency questions: one JSON line each way.
def socket_path(engine_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"kvplane-vllm-{engine_id[:40]}.sock")


class LookupServer:
    def __init__(self, store: Store, path: str) -> None:
        self.store, self.path = store, path
        if os.path.exists(path):
            os.unlink(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        threading.Thread(target=self._accept, name="kvplane-lookup", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as f:
            for line in f:
                try:
                    msg = json.loads(line)
                    if msg["op"] == "lookup":
                        n, nvme = self.store.lookup([Key(h, lo) for h, lo in msg["keys"]],
                                                    bool(msg.get("remote")))
                        reply: Dict[str, Any] = {"n": n, "nvme": nvme}
                    elif msg["op"] == "count":
                        self.store.count(msg["name"], int(msg["n"]))
                        self.store.flush()
                        reply = {}
                    else:
                        reply = {"error": f"unknown op {msg['op']!r}"}
                except Exception as e:  # noqa: BLE001 - answered, never fatal
                    reply = {"error": f"{type(e).__name__}: {e}"}
                f.write(json.dumps(reply).encode() + b"\n")
                f.flush()

    def close(self) -> None:
        self.sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


class LookupClient:
    def __init__(self, path: str) -> None:
        self.path = path
        self.f: Any = None
        self.lock = threading.Lock()

    def call(self, msg: Dict[str, Any]) -> Dict[str, Any]:
        with self.lock:
            for attempt in (0, 1):
                try:
                    if self.f is None:
                        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                        s.settimeout(60)
                        s.connect(self.path)
                        self.f = s.makefile("rwb")
                    self.f.write(json.dumps(msg).encode() + b"\n")
                    self.f.flush()
                    line = self.f.readline()
                    if not line:
                        raise ConnectionError("the worker closed the connection")
                    reply = json.loads(line)
                    if "error" in reply:
                        raise RuntimeError(reply["error"])
                    return reply
                except (OSError, ConnectionError):
                    self.f = None
                    if attempt:
                        raise
            raise AssertionError("unreachable")


# ---- metadata: scheduler -> worker -------------------------------------------------
@dataclass
class _Xfer:
    req_id: str
    keys: List[Key]
    block_ids: List[int]
    export: bool = False       # P/D: hand the blocks off to pd_dir too


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: List[_Xfer] = field(default_factory=list)
    saves: List[_Xfer] = field(default_factory=list)


@dataclass
class _Req:
    keys: List[Key]            # the prompt's full blocks, vLLM's hashes
    n_prompt: int              # prompt tokens
    saved: int = 0             # blocks [0, saved) are in kvtier or handed over
    load_start: int = 0        # blocks [load_start, load_end) to load
    load_end: int = 0
    nvme_tokens: int = 0       # of the offered tokens, read back from NVMe
    export: bool = False       # do_remote_decode on a producer with pd_dir


def _key_of(digest: bytes) -> Key:
    """vLLM's block hash -> kvplane's key: the digest's last 16 bytes (what
    kvplane's vLLM modes return; ``lo`` is the 64-bit form of KV events)."""
    b = bytes(digest)[-16:]
    return Key(int.from_bytes(b[:8], "big"), int.from_bytes(b[8:], "big"))


class KvtierConnector(KVConnectorBase_V1):
    """kvtier behind vLLM's KV-connector hooks (module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.opts = read_options(extra)
        par = vllm_config.parallel_config
        if par.world_size > 1:
            raise ValueError(f"kvplane.vllm: world size {par.world_size}: one worker "
                             "per engine (tensor/pipeline parallel is not supported yet)")
        cache = vllm_config.cache_config
        self.block_size = int(cache.block_size)
        self.model_id = self.opts.model_id or str(vllm_config.model_config.model)
        self._algo = str(getattr(cache, "prefix_caching_hash_algo", "sha256"))
        self._sock = socket_path(str(self._kv_transfer_config.engine_id))
        ktc = self._kv_transfer_config
        self._producer = ktc.kv_role in ("kv_producer", "kv_both")
        self._consumer = ktc.kv_role in ("kv_consumer", "kv_both")
        self._handoff: Optional[Handoff] = None
        if self.opts.pd_dir is not None:
            self._handoff = Handoff(self.opts.pd_dir, self.model_id, self.block_size,
                                    self.opts.durable)
        self._hasher: Optional[Hasher] = None
        self._reqs: Dict[str, _Req] = {}
        self._load_errors: Set[int] = set()
        self._warned: Set[str] = set()
        self.store: Optional[Store] = None        # worker side
        self._server: Optional[LookupServer] = None
        self._client: Optional[LookupClient] = None  # scheduler side
        if role == KVConnectorRole.SCHEDULER:
            if self._algo not in _ALGOS:
                raise ValueError(f"kvplane.vllm: --prefix-caching-hash-algo {self._algo}: "
                                 f"kvplane computes {sorted(_ALGOS)} for the connector")
            self._client = LookupClient(self._sock)
        log.info("kvplane.vllm: %s side, config %s, durable %s", role.name,
                 self.opts.config_path, self.opts.durable)

    # ---- scheduler side ------------------------------------------------------------
    def _warn_once(self, what: str, msg: str, *args: Any) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(msg, *args)

    def _ask(self, msg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
        try:
            return self._client.call(msg)
        except Exception as e:  # noqa: BLE001 - a miss, never a failed request
            self._warn_once("ask", "kvplane.vllm: the worker's lookup socket %s: %s: "
                            "requests miss", self._sock, e)
            return None

    def _count(self, name: str) -> None:
        self._ask({"op": "count", "name": name, "n": 1})

    def _hasher_for(self) -> Hasher:
        if self._hasher is None:  # vLLM's algorithms ignore the namespace seed
            seed = os.environ.get("PYTHONHASHSEED")
            self._hasher = Hasher(Namespace(self.model_id, self.block_size),
                                  _ALGOS[self._algo], python_hash_seed=seed)
        return self._hasher

    def _keys(self, request: Any) -> Optional[List[Key]]:
        """The prompt's full-block keys, or None (counted) when kvplane cannot
        vouch for them."""
        if request.mm_features or getattr(request, "prompt_embeds", None) is not None:
            self._count("unsupported")
            return None
        toks = request.prompt_token_ids or []
        lora = request.lora_request
        ex = Extras(lora_name=lora.lora_name if lora is not None else None,
                    cache_salt=request.cache_salt or None,
                    lora_path=getattr(lora, "lora_path", None) if lora is not None else None)
        try:
            keys = list(self._hasher_for().hash(toks, ex))
        except (KvplaneError, ValueError) as e:  # e.g. xxhash without PYTHONHASHSEED
            self._count("unsupported")
            self._warn_once("hasher", "kvplane.vllm: cannot reproduce vLLM's block "
                            "hashes (%s): requests miss", e)
            return None
        theirs = request.block_hashes
        n = min(len(theirs), len(keys))
        if any(_key_of(theirs[i]) != keys[i] for i in range(n)):
            self._count("hash_mismatch")
            self._warn_once("hash", "kvplane.vllm: kvplane's block keys differ from "
                            "vLLM's (algo %s, PYTHONHASHSEED %s): requests miss",
                            self._algo, os.environ.get("PYTHONHASHSEED"))
            return None
        return keys

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple:
        keys = self._keys(request)
        if keys is None:
            return 0, False
        n_prompt = len(request.prompt_token_ids or [])
        r = _Req(keys, n_prompt)
        self._reqs[request.request_id] = r
        kvp = request.kv_transfer_params or {}
        r.export = bool(self._handoff is not None and self._producer
                        and kvp.get("do_remote_decode"))
        start = num_computed_tokens // self.block_size
        limit = min(len(keys), (n_prompt - 1) // self.block_size)  # vLLM computes >= 1
        if start >= limit:
            return 0, False
        got = self._ask({"op": "lookup", "keys": [[k.hi, k.lo] for k in keys[start:limit]],
                         "remote": bool(kvp.get("do_remote_prefill"))})
        if got is None:
            return 0, False
        n, nvme = int(got["n"]), int(got["nvme"])
        # a hand-off covers the whole prompt, vLLM's own hit and kvtier's too
        r.saved = 0 if r.export else start + n
        if n == 0:
            return 0, False
        r.load_start, r.load_end = start, start + n
        r.nvme_tokens = nvme * self.block_size
        return n * self.block_size, False

    def get_external_cache_hit_sources(self, request: Any,
                                       num_external_tokens: int) -> dict:
        if num_external_tokens == 0:
            return {}
        r = self._reqs.get(request.request_id)
        nvme = min(r.nvme_tokens, num_external_tokens) if r is not None else 0
        out = {CacheHitSource.HOST: num_external_tokens - nvme, CacheHitSource.DISK: nvme}
        return {k: v for k, v in out.items() if v}

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None:
            return
        # vLLM may take fewer tokens than offered (or its own hit instead)
        r.load_end = r.load_start + num_external_tokens // self.block_size

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta = KvtierConnectorMetadata()
        so = scheduler_output
        state = getattr(so, "kv_connector_block_state", None)
        for new in so.scheduled_new_reqs:
            self._plan(meta, new.req_id, new.block_ids, new.num_computed_tokens, so)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is not None:
                self._plan(meta, req_id, ids, cached.num_computed_tokens[i], so)
        for req_id in so.finished_req_ids:
            self._reqs.pop(req_id, None)
        return meta

    def _plan(self, meta: KvtierConnectorMetadata, req_id: str, block_ids: Any,
              num_computed: int, so: Any) -> None:
        r = self._reqs.get(req_id)
        if r is None or not block_ids:
            return
        ids = list(block_ids[0])
        if r.load_end > r.load_start:
            a, b = r.load_start, r.load_end
            meta.loads.append(_Xfer(req_id, r.keys[a:b], ids[a:b]))
            r.load_start = r.load_end = 0
        done = min(r.n_prompt, num_computed + so.num_scheduled_tokens.get(req_id, 0))
        full = min(done // self.block_size, len(r.keys), len(ids))
        if full > r.saved:  # blocks completed by this step: saved after it
            meta.saves.append(_Xfer(req_id, r.keys[r.saved:full], ids[r.saved:full],
                                    r.export))
            r.saved = full

    def request_finished(self, request: Any, block_ids: List[int]) -> tuple:
        """A prefill leg (do_remote_decode, stopped by max_tokens, as the
        NIXL connector): the kv_transfer_params the decode leg gets, naming
        the prefix of full blocks handed off to pd_dir (checked there: the
        worker wrote them before this step's output reached the scheduler)."""
        r = self._reqs.pop(request.request_id, None)
        kvp = request.kv_transfer_params or {}
        if (self._handoff is None or not self._producer or not kvp.get("do_remote_decode")
                or request.status != RequestStatus.FINISHED_LENGTH_CAPPED):
            return False, None
        n = 0  # no keys (multimodal, hash mismatch): the decode computes all
        if r is not None and r.export:
            full = min(len(r.keys), len(block_ids), r.n_prompt // self.block_size)
            n = next((i for i in range(full) if not self._handoff.have(r.keys[i])), full)
        ktc = self._kv_transfer_config
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": str(ktc.engine_id),
                       "remote_block_ids": [int(b) for b in block_ids[:n]],
                       "remote_host": socket.gethostname() or "localhost",
                       "remote_port": int(ktc.kv_port),
                       "kvplane_handoff_blocks": n}

    # ---- worker side ---------------------------------------------------------------
    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        if self.store is not None:
            raise ValueError("kvplane.vllm: register_kv_caches called twice")
        first = next(iter(kv_caches.values()), None)
        backend = "cpu" if first is None or first.device.type == "cpu" else "cuda"
        dev = Device(backend)
        layout, tag = vllm_kv_layout(dev, kv_caches,
                                     getattr(self._kv_cache_config, "num_blocks", None),
                                     self.block_size)
        layout_id = f"vllm-{backend}:{first.dtype}:L{layout.num_layers}:{tag}"
        tier = TierStore.from_config(self.opts.yaml)
        ns = Namespace(self.model_id, self.block_size, kv_layout=layout_id)
        tier.add_namespace(ns, block_bytes=layout.block_bytes)
        link = TierLink(tier, dev, layout, ns)
        self.store = Store(self.opts, tier, ns, link, layout.block_bytes, self._handoff,
                           layout_id, self._consumer)
        self._server = LookupServer(self.store, self._sock)
        self.store.flush()
        log.info("kvplane.vllm: %d layers, %d blocks of %d bytes, layout %s, nvme %s, "
                 "lookups on %s", layout.num_layers, layout.num_blocks, layout.block_bytes,
                 layout_id, tier.nvme_dir, self._sock)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        st = self.store
        if st is None or not isinstance(meta, KvtierConnectorMetadata) or not meta.loads:
            return
        t0 = time.monotonic_ns()
        for x in meta.loads:
            got = st.link.load(x.keys, x.block_ids)
            st.count("loads")
            first = next((i for i, t in enumerate(got) if t is None), len(got))
            st.count("blocks_loaded", first)
            if first < len(got):  # from the first failure on: vLLM recomputes
                self._load_errors.update(x.block_ids[first:])
                st.count("load_failed_blocks", len(got) - first)
        st.count("load_ns", time.monotonic_ns() - t0)
        st.flush()

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # start_load_kv loaded every layer before the forward

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: Any, **kwargs: Any) -> None:
        return  # wait_for_save moves whole blocks, all layers at once

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        st = self.store
        if st is None or not isinstance(meta, KvtierConnectorMetadata) or not meta.saves:
            return
        t0 = time.monotonic_ns()
        for x in meta.saves:
            if self._kv_transfer_config.kv_role == "kv_consumer" and not x.export:
                continue  # a decode instance's blocks came from the prefill
            todo = []
            for i, k in enumerate(x.keys):
                t = st.store.contains(st.ns, k)
                if t == Tier.NVME and k in st.suspect:
                    # behind a slot that failed its checks: fresh KV replaces it
                    st.suspect.discard(k)
                    st.store.evict(st.ns, k)
                    st.count("blocks_replaced")
                    t = None
                if t is None:
                    todo.append(i)
            st.count("blocks_save_skipped", len(x.keys) - len(todo))
            if todo:
                self._save(st, x, todo)
            if x.export and st.handoff is not None:
                st.export_handoff(x.keys)
        st.count("save_ns", time.monotonic_ns() - t0)
        st.flush()

    def _save(self, st: Store, x: _Xfer, todo: List[int]) -> None:
        res = st.link.save([x.keys[i] for i in todo], [x.block_ids[i] for i in todo],
                           durable=self.opts.durable)
        ok = sum(1 for v in res if v >= 0)
        st.count("saves")
        st.count("blocks_saved", ok)
        if ok != len(res):
            st.count("save_failed_blocks", len(res) - ok)
            self._warn_once("save", "kvplane.vllm: kvtier refused %d of %d blocks "
                            "(first error %d)", len(res) - ok, len(res),
                            next(v for v in res if v < 0))

    def get_block_ids_with_load_errors(self) -> Set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self.store is not None:
            try:
                self.store.store.sync()
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("kvplane.vllm: store sync at shutdown: %s", e)
            self.store.dirty = True
            self.store.flush()
