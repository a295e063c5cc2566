# SPDX-License-Identifier: Apache-2.0
"""Shared helpers: errors, enums, keys and the zero-copy token/buffer paths."""
from __future__ import annotations

import enum
from typing import Any, Iterable, Iterator, NamedTuple, Optional, Sequence, Union

from ._kvplane import ffi, lib

# ---- errors -----------------------------------------------------------------


def _s(p: Any) -> str:
    return ffi.string(p).decode("utf-8", "replace") if p != ffi.NULL else ""


class KvplaneError(Exception):
    """A kvplane call failed.  ``code`` is the library's return code (a
    KVP_E* code below -4000, or -errno), ``name`` its symbolic name
    (kvp_err_name) and ``message`` its text (kvp_strerror)."""

    def __init__(self, code: int, where: str = "") -> None:
        self.code = int(code)
        self.name = _s(lib.kvp_err_name(self.code))
        self.message = _s(lib.kvp_strerror(self.code))
        self.where = where
        text = f"{self.name} ({self.code}): {self.message}"
        super().__init__(f"{where}: {text}" if where else text)


class InvalidArgumentError(KvplaneError, ValueError):
    """KVP_EINVAL / KVP_ERANGE: the arguments were refused (the library logs
    which field at KVP_LOG_WARN)."""


class NotFoundError(KvplaneError, LookupError):
    """KVP_ENOENT: no such entry (worker, namespace, tenant ...)."""


class StateError(KvplaneError):
    """KVP_ESTATE / KVP_EEXIST / KVP_EBUSY: the object is in the wrong state."""


class NoSpaceError(KvplaneError):
    """KVP_ENOSPC: no room in a buffer or tier."""


_CLASSES = {
    lib.KVP_EINVAL: InvalidArgumentError,
    lib.KVP_ERANGE: InvalidArgumentError,
    lib.KVP_ENOENT: NotFoundError,
    lib.KVP_ESTATE: StateError,
    lib.KVP_EEXIST: StateError,
    lib.KVP_EBUSY: StateError,
    lib.KVP_ENOSPC: NoSpaceError,
}


def error(code: int, where: str = "") -> KvplaneError:
    """The exception for return code ``code`` (its class by code)."""
    if code == lib.KVP_ENOMEM:
        return KvplaneError(code, where)
    return _CLASSES.get(code, KvplaneError)(code, where)


def check(rc: int, where: str) -> int:
    """rc if >= 0, else raise the matching KvplaneError."""
    if rc < 0:
        raise error(rc, where)
    return rc


def strerror(code: int) -> str:
    return _s(lib.kvp_strerror(code))


def err_name(code: int) -> str:
    return _s(lib.kvp_err_name(code))


# ---- shared vocabulary (values from the compiled headers) --------------------


class Tier(enum.IntEnum):
    """Where a block's KV lives, fastest first (kvp_tier)."""
    HBM = lib.KVP_TIER_HBM
    DRAM = lib.KVP_TIER_DRAM
    NVME = lib.KVP_TIER_NVME
    REMOTE = lib.KVP_TIER_REMOTE

    @property
    def label(self) -> str:
        return _s(lib.kvp_tier_name(self))


class StabilityClass(enum.IntEnum):
    """Segment class of a block, least reusable first (kvp_class)."""
    VOLATILE = lib.KVP_CLASS_VOLATILE
    SEMI = lib.KVP_CLASS_SEMI
    STABLE = lib.KVP_CLASS_STABLE

    @property
    def label(self) -> str:
        return _s(lib.kvp_class_name(self))


TIER_COUNT = lib.KVP_TIER_COUNT_
CLASS_COUNT = lib.KVP_CLASS_COUNT_
TierLike = Union[Tier, int, str]
ClassLike = Union[StabilityClass, int, str]


def tier_of(t: TierLike) -> int:
    """A Tier, its int value or its name ("hbm", "dram", "nvme", "remote")."""
    if isinstance(t, str):
        out = ffi.new("kvp_tier *")
        check(lib.kvp_tier_parse(t.encode(), out), f"tier {t!r}")
        return int(out[0])
    return int(Tier(t))


def class_of(c: ClassLike) -> int:
    """A StabilityClass, its value or its name ("volatile", "semi", "stable")."""
    if isinstance(c, str):
        out = ffi.new("kvp_class *")
        check(lib.kvp_class_parse(c.encode(), out), f"class {c!r}")
        return int(out[0])
    return int(StabilityClass(c))


def id64(name: Optional[str]) -> int:
    """kvp_id64: the router's 64-bit id of a caller's string id (tenant,
    session, request); None or "" -> 0."""
    if not name:
        return 0
    return int(lib.kvp_id64(name.encode()))


def id_of(v: Union[None, int, str]) -> int:
    return id64(v) if isinstance(v, str) or v is None else int(v)


def cstr(s: Optional[str], keep: list) -> Any:
    """A NUL-terminated UTF-8 char[] kept alive in ``keep`` (NULL for None)."""
    if s is None:
        return ffi.NULL
    p = ffi.new("char[]", s.encode("utf-8"))
    keep.append(p)
    return p


# ---- keys ---------------------------------------------------------------------


class Key(NamedTuple):
    """A 128-bit block key.  For vLLM algorithms ``lo`` is the 64-bit form
    vLLM publishes in KV events."""
    hi: int
    lo: int

    def hex(self) -> str:
        """32 hex digits, hi then lo (what ``kvplane hash`` prints)."""
        return f"{self.hi:016x}{self.lo:016x}"

    def __int__(self) -> int:
        return (self.hi << 64) | self.lo


class Keys(Sequence[Key]):
    """An owned array of block keys (kvp_key[]), passed to the index, the
    router and the tier store without conversion.  ``tail`` is the number of
    tokens after the last full block when it came from a hash."""

    __slots__ = ("_arr", "_n", "tail")

    def __init__(self, arr: Any, n: int, tail: int = 0) -> None:
        self._arr = arr
        self._n = n
        self.tail = tail

    @classmethod
    def from_keys(cls, keys: Iterable[Union[Key, tuple, int]]) -> "Keys":
        """From Key tuples, (hi, lo) pairs or 128-bit ints."""
        items = [k if isinstance(k, tuple) else (int(k) >> 64, int(k) & (2**64 - 1))
                 for k in keys]
        arr = ffi.new("kvp_key[]", max(len(items), 1))
        for i, (hi, lo) in enumerate(items):
            arr[i].hi, arr[i].lo = hi, lo
        return cls(arr, len(items))

    @classmethod
    def copy_of(cls, ptr: Any, n: int, tail: int = 0) -> "Keys":
        arr = ffi.new("kvp_key[]", max(n, 1))
        if n:
            ffi.memmove(arr, ptr, n * ffi.sizeof("kvp_key"))
        return cls(arr, n, tail)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            idx = range(*i.indices(self._n))
            if i.step in (None, 1):
                return Keys.copy_of(self._arr + idx.start, len(idx))
            return Keys.from_keys(self[j] for j in idx)
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("key index out of range")
        k = self._arr[i]
        return Key(int(k.hi), int(k.lo))

    def __iter__(self) -> Iterator[Key]:
        for i in range(self._n):
            k = self._arr[i]
            yield Key(int(k.hi), int(k.lo))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Keys):
            return bytes(self.buffer()) == bytes(other.buffer())
        return list(self) == list(other) if isinstance(other, (list, tuple)) else NotImplemented

    def __repr__(self) -> str:
        return f"Keys(n={self._n}, tail={self.tail})"

    @property
    def lo(self) -> list:
        """The 64-bit fingerprints (vLLM's event hashes for vLLM algorithms)."""
        return [int(self._arr[i].lo) for i in range(self._n)]

    def hex(self) -> list:
        return [k.hex() for k in self]

    def buffer(self) -> memoryview:
        """The raw kvp_key array (16 bytes a key, native endian), zero-copy."""
        return memoryview(ffi.buffer(self._arr, self._n * ffi.sizeof("kvp_key")))

    def numpy(self):
        """A zero-copy numpy view, dtype [('hi', u8), ('lo', u8)]."""
        import numpy as np
        return np.frombuffer(self.buffer(), dtype=[("hi", "=u8"), ("lo", "=u8")])

    @property
    def ptr(self) -> Any:
        """The kvp_key * (for other cffi code); valid while this object lives."""
        return self._arr


KeysLike = Union[Keys, Iterable[Union[Key, tuple, int]]]


def as_keys(keys: KeysLike) -> Keys:
    return keys if isinstance(keys, Keys) else Keys.from_keys(keys)


def key_struct(k: Union[Key, tuple, int]) -> Any:
    """A kvp_key value (by-value argument) from a Key, (hi, lo) or int."""
    s = ffi.new("kvp_key *")
    hi, lo = k if isinstance(k, tuple) else (int(k) >> 64, int(k) & (2**64 - 1))
    s.hi, s.lo = hi, lo
    return s[0]


# ---- tokens and buffers ----------------------------------------------------------

_U32_FORMATS = {"i", "I", "=i", "=I", "<i", "<I", "@i", "@I", "l", "L", "=l", "=L"}


def tokens_view(tokens: Any) -> tuple:
    """(uint32_t * cdata, n, keepalive) for token ids given as a list/tuple,
    array('i'/'I'), a numpy int32/uint32 array, a memoryview or anything with
    the buffer protocol of 4-byte C-contiguous integers: those are passed
    zero-copy; other sequences (and numpy arrays of other integer types)
    are copied once, with a range check (0 <= id < 2**32)."""
    try:
        mv = memoryview(tokens)
    except TypeError:
        mv = None
    if mv is not None and mv.itemsize == 4 and mv.format in _U32_FORMATS \
            and mv.c_contiguous:
        n = mv.nbytes // 4
        if n == 0:
            return ffi.NULL, 0, None
        return ffi.cast("uint32_t *", ffi.from_buffer(mv)), n, mv
    if hasattr(tokens, "dtype") and hasattr(tokens, "astype"):  # numpy-like
        if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
            raise ValueError("token id outside 0 .. 2**32-1")
        arr = tokens.astype("uint32").ravel()
        return tokens_view(arr)
    seq = list(tokens)
    if not seq:
        return ffi.NULL, 0, None
    try:
        arr = ffi.new("uint32_t[]", seq)
    except OverflowError as e:
        raise ValueError(f"token id outside 0 .. 2**32-1: {e}") from None
    return arr, len(seq), arr


def read_buffer(data: Any) -> tuple:
    """(void * cdata, nbytes, keepalive) over bytes, bytearray, memoryview,
    numpy arrays (C-contiguous) or a CPU tensor with data_ptr(): zero-copy."""
    if hasattr(data, "data_ptr") and not isinstance(data, (bytes, bytearray, memoryview)):
        return _tensor_buffer(data)
    cd = ffi.from_buffer(data)
    return cd, len(ffi.buffer(cd)), cd


def write_buffer(out: Any) -> tuple:
    """(void * cdata, capacity, keepalive) over a writable buffer: bytearray,
    memoryview, numpy array, mmap, or a CPU tensor (data_ptr): zero-copy."""
    if hasattr(out, "data_ptr") and not isinstance(out, (bytearray, memoryview)):
        return _tensor_buffer(out)
    cd = ffi.from_buffer(out, require_writable=True)
    return cd, len(ffi.buffer(cd)), cd


def _tensor_buffer(t: Any) -> tuple:
    """A torch-style tensor: contiguous, on the CPU, data_ptr() + nbytes."""
    dev = getattr(t, "device", None)
    if dev is not None and getattr(dev, "type", "cpu") != "cpu":
        raise ValueError("tensor is not on the CPU: copy it to host memory "
                         "(the package moves bytes between host buffers)")
    if hasattr(t, "is_contiguous") and not t.is_contiguous():
        raise ValueError("tensor is not contiguous")
    nbytes = t.nbytes if hasattr(t, "nbytes") else t.numel() * t.element_size()
    return ffi.cast("void *", t.data_ptr()), int(nbytes), t


class Owner:
    """A C handle whose destroy waits for the handles that depend on it.

    Objects collected together (a reference cycle) are finalized in no
    particular order: a TierStore may be finalized before the TierLink
    that points into it.  Each object therefore frees its handle through an
    Owner (no finalizer of its own): close() marks it, and it is destroyed
    once it is closed and every dependent Owner has been destroyed."""

    def __init__(self, ptr: Any, destroy: Any, parents: Sequence["Owner"] = ()) -> None:
        self.ptr, self._destroy, self.parents = ptr, destroy, list(parents)
        self.deps, self.closing = 0, False
        for p in self.parents:
            p.deps += 1

    def close(self) -> None:
        self.closing = True
        self._maybe_free()

    def _maybe_free(self) -> None:
        if not self.closing or self.deps or self.ptr is None:
            return
        ptr, self.ptr = self.ptr, None
        self._destroy(ptr)
        for p in self.parents:
            p.deps -= 1
            p._maybe_free()
