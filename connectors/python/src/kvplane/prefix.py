# SPDX-License-Identifier: Apache-2.0
"""Namespaces, block hashing (Hasher, Chain), the stability classifier and
prompt-drift reports (include/kvplane/prefix.h)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from ._kvplane import ffi, lib
from ._util import (CLASS_COUNT, Key, Keys, KeysLike, StabilityClass, _s,
                    as_keys, check, cstr, id_of, tokens_view)


class HashAlgo(enum.IntEnum):
    """kvp_hash_algo.  XXH3_128 and SHA256 are kvplane's own (namespaced);
    the others reproduce vLLM's block hashes exactly."""
    XXH3_128 = lib.KVP_HASH_XXH3_128
    SHA256 = lib.KVP_HASH_SHA256
    SHA256_CBOR = lib.KVP_HASH_SHA256_CBOR
    XXHASH_CBOR = lib.KVP_HASH_XXHASH_CBOR
    VLLM_SHA256 = lib.KVP_HASH_VLLM_SHA256
    VLLM_XXHASH = lib.KVP_HASH_VLLM_XXHASH

    @classmethod
    def parse(cls, name: str) -> "HashAlgo":
        """kvplane's names (xxh3_128, sha256, sha256_cbor, xxhash_cbor,
        vllm_sha256, vllm_xxhash)."""
        out = ffi.new("kvp_hash_algo *")
        check(lib.kvp_hash_algo_parse(name.encode(), out), f"hash algo {name!r}")
        return cls(out[0])

    @classmethod
    def from_vllm(cls, name: str) -> "HashAlgo":
        """vLLM's --prefix-caching-hash-algo names (sha256, sha256_cbor,
        xxhash, xxhash_cbor)."""
        out = ffi.new("kvp_hash_algo *")
        check(lib.kvp_hash_algo_from_vllm(name.encode(), out), f"vLLM algo {name!r}")
        return cls(out[0])

    @property
    def label(self) -> str:
        return _s(lib.kvp_hash_algo_name(self))

    @property
    def digest_len(self) -> int:
        return int(lib.kvp_hash_algo_digest_len(self))


class VllmCompat(enum.IntEnum):
    """Which vLLM release's hash inputs to reproduce (kvp_vllm_compat)."""
    LATEST = lib.KVP_VLLM_COMPAT_LATEST
    PRE_0_33 = lib.KVP_VLLM_COMPAT_PRE_0_33
    V0_33 = lib.KVP_VLLM_COMPAT_0_33


class Role(enum.IntEnum):
    """Segment role (kvp_role)."""
    OTHER = lib.KVP_ROLE_OTHER
    SYSTEM = lib.KVP_ROLE_SYSTEM
    TOOLS = lib.KVP_ROLE_TOOLS
    DOCUMENTS = lib.KVP_ROLE_DOCUMENTS
    HISTORY = lib.KVP_ROLE_HISTORY
    USER = lib.KVP_ROLE_USER
    TOOL_OUTPUT = lib.KVP_ROLE_TOOL_OUTPUT

    @property
    def label(self) -> str:
        return _s(lib.kvp_role_name(self))

    @property
    def default_class(self) -> StabilityClass:
        return StabilityClass(lib.kvp_role_default_class(self))


class Namespace:
    """Everything that makes two caches' KV bytes incompatible (model,
    tokenizer, KV layout, block size, tenant salt), reduced to a 128-bit
    seed (kvp_namespace_init).  Immutable; thread-safe."""

    def __init__(self, model_id: str, block_size: int, tokenizer_id: str = "",
                 kv_layout: str = "", tenant_salt: Optional[str] = None) -> None:
        keep: list = []
        d = ffi.new("kvp_namespace_desc *")
        d.model_id = cstr(model_id, keep)
        d.tokenizer_id = cstr(tokenizer_id, keep)
        d.kv_layout = cstr(kv_layout, keep)
        d.block_size = block_size
        d.tenant_salt = cstr(tenant_salt, keep)
        self._ns = ffi.new("kvp_namespace *")
        check(lib.kvp_namespace_init(d, self._ns), "Namespace")
        self.model_id, self.tokenizer_id = model_id, tokenizer_id
        self.kv_layout, self.tenant_salt = kv_layout, tenant_salt

    @property
    def block_size(self) -> int:
        return int(self._ns.block_size)

    @property
    def seed(self) -> Key:
        return Key(int(self._ns.seed.hi), int(self._ns.seed.lo))

    def __repr__(self) -> str:
        return (f"Namespace(model_id={self.model_id!r}, block_size="
                f"{self.block_size}, seed={self.seed.hex()})")


@dataclass
class MMSpan:
    """A multimodal placeholder in token coordinates (vLLM PlaceholderRange)."""
    id: str
    offset: int
    length: int


@dataclass
class Extras:
    """Per-request extra keys, as vLLM's generate_block_hash_extra_keys uses
    them: LoRA name (and path, vLLM >= 0.33), cache salt, multimodal spans
    sorted by offset."""
    lora_name: Optional[str] = None
    cache_salt: Optional[str] = None
    mm: Sequence[MMSpan] = field(default_factory=list)
    lora_path: Optional[str] = None

    def _c(self, keep: list) -> Any:
        e = ffi.new("kvp_extras *")
        keep.append(e)
        e.lora_name = cstr(self.lora_name, keep)
        e.cache_salt = cstr(self.cache_salt, keep)
        e.lora_path = cstr(self.lora_path, keep)
        if self.mm:
            spans = ffi.new("kvp_mm_span[]", len(self.mm))
            keep.append(spans)
            for i, s in enumerate(self.mm):
                spans[i].id = cstr(s.id, keep)
                spans[i].offset, spans[i].length = s.offset, s.length
            e.mm, e.n_mm = spans, len(self.mm)
        return e


def _extras(x: Optional[Extras], keep: list) -> Any:
    return ffi.NULL if x is None else x._c(keep)


class Hasher:
    """An algorithm bound to a namespace (kvp_hasher).  NOT thread-safe: one
    per thread (cheap); a hasher and its chains are used by one thread at a
    time.  The GIL is released while C hashes."""

    def __init__(self, ns: Namespace, algo: Union[HashAlgo, str] = HashAlgo.XXH3_128,
                 python_hash_seed: Optional[str] = None,
                 vllm_compat: VllmCompat = VllmCompat.LATEST) -> None:
        if isinstance(algo, str):
            algo = HashAlgo.parse(algo)
        keep: list = []
        o = ffi.new("kvp_hasher_opts *")
        o.algo = algo
        o.python_hash_seed = cstr(python_hash_seed, keep)
        o.vllm_compat = vllm_compat
        out = ffi.new("kvp_hasher **")
        check(lib.kvp_hasher_create(ns._ns, o, ffi.NULL, out), "Hasher")
        self._h = ffi.gc(out[0], lib.kvp_hasher_destroy)
        self.namespace = ns

    @property
    def algo(self) -> HashAlgo:
        return HashAlgo(lib.kvp_hasher_algo(self._h))

    @property
    def block_size(self) -> int:
        return int(lib.kvp_hasher_block_size(self._h))

    def hash(self, tokens: Any, extras: Optional[Extras] = None) -> Keys:
        """Keys of the full blocks of ``tokens`` (list, array('i'), numpy
        int32/uint32 -- zero-copy -- or any int sequence); ``.tail`` of the
        result is the number of tokens after the last full block."""
        ptr, n, _keep = tokens_view(tokens)
        keep: list = []
        nb = n // self.block_size
        arr = ffi.new("kvp_key[]", max(nb, 1))
        tail = ffi.new("size_t *")
        if ptr == ffi.NULL:
            ptr = ffi.new("uint32_t[1]")
        rc = lib.kvp_hasher_hash(self._h, ptr, n, _extras(extras, keep), arr,
                                 nb, tail)
        check(rc, "Hasher.hash")
        return Keys(arr, nb, int(tail[0]))

    def close(self) -> None:
        if self._h is not None:
            ffi.release(self._h)
            self._h = None

    def __enter__(self) -> "Hasher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Chain:
    """The growing key chain of one prompt or session (kvp_chain): extend it
    with new tokens, never rehashing the prefix.  Borrows the hasher (same
    thread rules)."""

    def __init__(self, hasher: Hasher, extras: Optional[Extras] = None,
                 chunk_tokens: Sequence[int] = (), keep_digests: bool = False) -> None:
        if len(chunk_tokens) > 4:
            raise ValueError("at most 4 chunk granularities")
        o = ffi.new("kvp_chain_opts *")
        for i, c in enumerate(chunk_tokens):
            o.chunk_tokens[i] = c
        o.keep_digests = 1 if keep_digests else 0
        keep: list = []
        out = ffi.new("kvp_chain **")
        check(lib.kvp_chain_create(hasher._h, o, _extras(extras, keep), ffi.NULL,
                                   out), "Chain")
        self._c = ffi.gc(out[0], lib.kvp_chain_destroy)
        self.hasher = hasher  # the chain borrows it: keep it alive
        self.digest_len = hasher.algo.digest_len

    def extend(self, tokens: Any) -> int:
        """Append tokens; returns the number of new full blocks."""
        ptr, n, _keep = tokens_view(tokens)
        if n == 0:
            return 0
        return check(lib.kvp_chain_extend(self._c, ptr, n), "Chain.extend")

    def reset(self) -> None:
        lib.kvp_chain_reset(self._c)

    def __len__(self) -> int:
        return int(lib.kvp_chain_len(self._c))

    @property
    def tokens(self) -> int:
        return int(lib.kvp_chain_tokens(self._c))

    @property
    def tail(self) -> int:
        return int(lib.kvp_chain_tail(self._c))

    @property
    def keys(self) -> Keys:
        """A copy of the keys so far (the C pointer moves on extend)."""
        return Keys.copy_of(lib.kvp_chain_keys(self._c), len(self), self.tail)

    def chunk_keys(self, chunk_tokens: int) -> Keys:
        n = ffi.new("size_t *")
        p = lib.kvp_chain_chunk_keys(self._c, chunk_tokens, n)
        if p == ffi.NULL:
            raise ValueError(f"chunk granularity {chunk_tokens} was not asked for")
        return Keys.copy_of(p, int(n[0]))

    def digest(self, i: int) -> bytes:
        """Block i's full digest (keep_digests=True): 16 or 32 bytes."""
        buf = ffi.new("uint8_t[32]")
        n = check(lib.kvp_chain_digest(self._c, i, buf, 32), "Chain.digest")
        return bytes(ffi.buffer(buf, n))

    def close(self) -> None:
        if self._c is not None:
            ffi.release(self._c)
            self._c = None

    def __enter__(self) -> "Chain":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class SegmentMark:
    """Tokens [offset, offset + length) with a role and an optional class
    hint (None = the role's default)."""
    offset: int
    length: int
    role: Role = Role.OTHER
    class_hint: Optional[StabilityClass] = None


def _marks(marks: Optional[Sequence[SegmentMark]]) -> tuple:
    if not marks:
        return ffi.NULL, 0
    arr = ffi.new("kvp_segment_mark[]", len(marks))
    for i, m in enumerate(marks):
        arr[i].offset, arr[i].length, arr[i].role = m.offset, m.length, int(m.role)
        arr[i].class_hint = lib.KVP_CLASS_AUTO if m.class_hint is None else int(m.class_hint)
    return arr, len(marks)


@dataclass
class Classification:
    """Blocks [0, stable_end) stable, [stable_end, semi_end) semi-stable,
    [semi_end, n_blocks) volatile; ``tokens`` per class (tail volatile)."""
    stable_end: int
    semi_end: int
    n_blocks: int
    learned_blocks: int
    tokens: dict
    _c: Any = field(default=None, repr=False, compare=False)

    def classes(self) -> list:
        """The class of each block."""
        return ([StabilityClass.STABLE] * self.stable_end
                + [StabilityClass.SEMI] * (self.semi_end - self.stable_end)
                + [StabilityClass.VOLATILE] * (self.n_blocks - self.semi_end))


class Stability:
    """The learned stability classifier (kvp_stability).  Not thread-safe:
    one per router thread, or lock around it."""

    def __init__(self, capacity: int = 0, stable_sessions: int = 0,
                 semi_repeats: int = 0) -> None:
        o = ffi.new("kvp_stability_opts *")
        o.capacity, o.stable_sessions, o.semi_repeats = capacity, stable_sessions, semi_repeats
        out = ffi.new("kvp_stability **")
        check(lib.kvp_stability_create(o, ffi.NULL, out), "Stability")
        self._s = ffi.gc(out[0], lib.kvp_stability_destroy)

    def observe(self, session: Union[int, str], keys: KeysLike, block_size: int,
                tail: Optional[int] = None,
                marks: Optional[Sequence[SegmentMark]] = None) -> Classification:
        """Learn one request of ``session`` (an id, or a string hashed with
        kvp_id64) and classify its blocks.  ``tail`` defaults to keys.tail."""
        k = as_keys(keys)
        m, nm = _marks(marks)
        out = ffi.new("kvp_classification *")
        t = k.tail if tail is None else tail
        check(lib.kvp_stability_observe(self._s, id_of(session), k.ptr, len(k),
                                        block_size, t, m, nm, out), "Stability.observe")
        return Classification(int(out.stable_end), int(out.semi_end), int(out.n_blocks),
                              int(out.learned_blocks),
                              {StabilityClass(c): int(out.tokens[c]) for c in range(CLASS_COUNT)},
                              _c=out)

    def __len__(self) -> int:
        return int(lib.kvp_stability_size(self._s))

    def close(self) -> None:
        if self._s is not None:
            ffi.release(self._s)
            self._s = None

    def __enter__(self) -> "Stability":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@dataclass
class Turn:
    """One turn for the drift detector: its keys, its tokens, its marks."""
    keys: KeysLike
    tokens: Any
    marks: Optional[Sequence[SegmentMark]] = None


@dataclass
class DriftReport:
    """Why a turn missed: where it diverged from the previous one and how
    much of the previous turn reappears later (kvp_drift_report)."""
    first_diverging_block: int
    common_prefix_tokens: int
    role: Role
    reappearing_tokens: int
    shifted_tokens: int
    lost_tokens: int


def _view(t: Turn, keep: list) -> Any:
    v = ffi.new("kvp_turn_view *")
    k = as_keys(t.keys)
    ptr, n, kt = tokens_view(t.tokens)
    m, nm = _marks(t.marks)
    keep += [k, kt, m]
    v.keys, v.n_blocks, v.tokens, v.n_tokens = k.ptr, len(k), ptr, n
    v.marks, v.n_marks = m, nm
    return v


def drift_compare(prev: Turn, cur: Turn, block_size: int) -> DriftReport:
    """Compare a session's previous turn with this one (kvp_drift_compare)."""
    keep: list = []
    out = ffi.new("kvp_drift_report *")
    check(lib.kvp_drift_compare(_view(prev, keep), _view(cur, keep), block_size,
                                ffi.NULL, out), "drift_compare")
    return DriftReport(int(out.first_diverging_block), int(out.common_prefix_tokens),
                       Role(out.role), int(out.reappearing_tokens),
                       int(out.shifted_tokens), int(out.lost_tokens))
