# SPDX-License-Identifier: Apache-2.0
"""The device side (include/kvplane/device.h, the link of tier.h): a
backend (CPU reference or CUDA), an engine's paged KV cache described as a
layout, gather/scatter of block ids between that cache and a staging
buffer, and TierLink, which saves cache blocks into a TierStore and loads
them back into any block ids.

Tensors come in as torch tensors (``data_ptr()``; CUDA tensors on the CUDA
backend), as numpy arrays (``__array_interface__``: host memory, the CPU
backend or host memory registered with the device) or as anything with
``__cuda_array_interface__``.  Shapes and dtypes are checked here, in
Python, before the C call; the GIL is released during every C call."""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ._kvplane import ffi, lib
from ._util import (ClassLike, KeysLike, Owner, StabilityClass, Tier, as_keys, check,
                    class_of, error, read_buffer, write_buffer)
from .index import struct_fields
from .prefix import Namespace
from .tier import TierStore

_BACKENDS = {"cpu": lib.KVP_BACKEND_CPU, "cuda": lib.KVP_BACKEND_CUDA,
             "hip": lib.KVP_BACKEND_HIP}
_METHODS = {"auto": lib.KVP_XFER_AUTO, "kernel": lib.KVP_XFER_KERNEL,
            "copy_engine": lib.KVP_XFER_COPY_ENGINE}
_METHOD_NAMES = {v: k for k, v in _METHODS.items()}
# kind -> (per-layer tensors?, separate K and V?, shape of one tensor)
_KINDS = {
    "vllm_nhd": (lib.KVP_LAYOUT_VLLM_NHD, True, True, "NB,BS,H,D"),
    "vllm_hnd": (lib.KVP_LAYOUT_VLLM_HND, True, True, "NB,H,BS,D"),
    "vllm_nhd_kv": (lib.KVP_LAYOUT_VLLM_NHD_KV, True, False, "2,NB,BS,H,D"),
    "vllm_hnd_kv": (lib.KVP_LAYOUT_VLLM_HND_KV, True, False, "2,NB,H,BS,D"),
    "mla": (lib.KVP_LAYOUT_MLA, True, False, "NB,BS,D"),
    "cross_layer": (lib.KVP_LAYOUT_CROSS_LAYER, False, False, "NB,L,2,BS,H,D"),
}


def backend_available(backend: str) -> Tuple[bool, str]:
    """(usable here?, reason when not) for "cpu", "cuda" or "hip"."""
    why = ffi.new("char[256]")
    ok = lib.kvp_backend_available(_backend(backend), why, 256)
    return bool(ok), ffi.string(why).decode("utf-8", "replace")


def _device_destroy(registered: Dict[int, Any], d: Any) -> None:
    for key in list(registered):
        lib.kvp_device_host_unregister(d, ffi.cast("void *", key))
    registered.clear()
    lib.kvp_device_destroy(d)


def _backend(name: str) -> int:
    if name not in _BACKENDS:
        raise ValueError(f"backend {name!r}: one of {sorted(_BACKENDS)}")
    return _BACKENDS[name]


@dataclass
class TensorInfo:
    """What the layout needs of one tensor: where it is and its shape."""
    ptr: int
    shape: Tuple[int, ...]
    itemsize: int
    dtype: str
    on_gpu: bool
    writable: bool


def _contiguous(shape: Sequence[int], strides: Optional[Sequence[int]],
                itemsize: int) -> bool:
    if strides is None:
        return True
    want = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n != 1 and s != want:
            return False
        want *= n
    return True


def _from_interface(a: dict, on_gpu: bool, what: str) -> TensorInfo:
    shape, typestr = tuple(int(n) for n in a["shape"]), a["typestr"]
    itemsize = int(typestr[2:])
    if not _contiguous(shape, a.get("strides"), itemsize):
        raise ValueError(f"{what}: not C-contiguous (strides {a.get('strides')})")
    ptr, readonly = a["data"]
    return TensorInfo(int(ptr), shape, itemsize, typestr[1:], on_gpu, not readonly)


def tensor_info(t: Any, what: str = "tensor") -> TensorInfo:
    """A torch tensor, numpy array or (cuda_)array_interface object."""
    if hasattr(t, "data_ptr") and hasattr(t, "element_size"):
        if not t.is_contiguous():
            raise ValueError(f"{what}: tensor is not contiguous")
        return TensorInfo(int(t.data_ptr()), tuple(int(n) for n in t.shape),
                          int(t.element_size()), str(t.dtype).replace("torch.", ""),
                          t.device.type != "cpu", True)
    if hasattr(t, "__cuda_array_interface__"):
        return _from_interface(t.__cuda_array_interface__, True, what)
    if hasattr(t, "__array_interface__"):
        return _from_interface(t.__array_interface__, False, what)
    raise TypeError(f"{what}: expected a torch tensor or a numpy array, got "
                    f"{type(t).__name__}")


class Device:
    """kvp_device: ``Device("cpu")`` (host pointers; the reference) or
    ``Device("cuda", ordinal=0)`` (retains the primary context PyTorch
    uses).  Thread-safe.  close() closes its layouts and links first."""

    def __init__(self, backend: str = "cpu", ordinal: int = 0, cta_budget: int = 0,
                 calibrate: bool = True) -> None:
        self._d = None
        self._registered: Dict[int, Any] = {}
        self._children: "weakref.WeakSet[Any]" = weakref.WeakSet()
        b = _backend(backend)
        ok, why = backend_available(backend)
        if not ok:
            raise error(lib.KVP_ENOTSUP, f"Device({backend!r}): {why}")
        o = ffi.new("kvp_device_opts *")
        o.backend, o.ordinal, o.cta_budget = b, ordinal, cta_budget
        o.flags = 0 if calibrate else lib.KVP_DEVICE_NO_CALIBRATE
        out = ffi.new("kvp_device **")
        check(lib.kvp_device_create(o, ffi.NULL, out), f"Device({backend!r})")
        self._d = out[0]
        self._owner = Owner(self._d, functools.partial(_device_destroy, self._registered))
        self.backend = backend

    def _live(self) -> Any:
        if self._d is None:
            raise ValueError("Device is closed")
        return self._d

    def _check(self, rc: int, where: str) -> int:
        if rc == lib.KVP_EGPU and self._d is not None:
            name = ffi.new("const char **")
            code = lib.kvp_device_native_error(self._d, name)
            n = ffi.string(name[0]).decode() if name[0] != ffi.NULL else "?"
            where = f"{where} ({n} = {code})"
        return check(rc, where)

    @property
    def name(self) -> str:
        return ffi.string(lib.kvp_device_name(self._live())).decode()

    def synchronize(self) -> None:
        """Wait for the work queued on the device's own stream."""
        self._check(lib.kvp_device_synchronize(self._live()), "Device.synchronize")

    def host_register(self, buf: Any) -> None:
        """Pin a writable host buffer (numpy array, bytearray, CPU tensor)
        and map it into the device so it can be staging or an engine
        tensor.  The Device keeps it alive until host_unregister/close.  A
        no-op on the CPU backend (which still records the range)."""
        ptr, n, keep = write_buffer(buf)
        key = int(ffi.cast("uintptr_t", ptr))
        self._check(lib.kvp_device_host_register(self._live(), ptr, n),
                    "Device.host_register")
        self._registered[key] = keep

    def host_unregister(self, buf: Any) -> None:
        ptr, _n, _keep = write_buffer(buf)
        key = int(ffi.cast("uintptr_t", ptr))
        self._check(lib.kvp_device_host_unregister(self._live(), ptr),
                    "Device.host_unregister")
        self._registered.pop(key, None)

    def stream(self, native: Optional[int] = None) -> "Stream":
        """Wrap an engine's stream handle (torch:
        ``torch.cuda.current_stream().cuda_stream``) so transfers order with
        its kernels.  None: the legacy default stream."""
        return Stream(self, native)

    def close(self) -> None:
        if self._d is None:
            return
        # links before stores and layouts, streams last
        for order in (TierLink, TierStore, KvLayout, Stream):
            for c in [c for c in self._children if isinstance(c, order)]:
                c.close()
        self._d = None
        self._owner.close()  # unregisters the host buffers, destroys

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Stream:
    """A wrapped engine stream (kvp_stream_wrap); not owned."""

    def __init__(self, dev: Device, native: Optional[int]) -> None:
        self._s, self.device = None, dev
        out = ffi.new("kvp_stream **")
        h = ffi.cast("void *", native or 0)
        dev._check(lib.kvp_stream_wrap(dev._live(), h, out), "Device.stream")
        self._s = out[0]
        self._owner = Owner(self._s, lib.kvp_stream_destroy, [dev._owner])
        dev._children.add(self)

    def synchronize(self) -> None:
        self.device._check(lib.kvp_stream_synchronize(self._s), "Stream.synchronize")

    def close(self) -> None:
        if self._s is not None:
            self._s = None
            self._owner.close()

    def __del__(self) -> None:
        self.close()


def _stream_ptr(s: Optional[Stream]) -> Any:
    return ffi.NULL if s is None else s._s


def _u32_array(ids: Any, what: str) -> Tuple[Any, int]:
    try:
        seq = [int(i) for i in ids]
        return ffi.new("uint32_t[]", seq or [0]), len(seq)
    except OverflowError:
        raise ValueError(f"{what}: ids must be in 0 .. 2**32-1") from None


def _dims(spec: str, d: Dict[str, int]) -> Tuple[int, ...]:
    return tuple(int(p) if p.isdigit() else d[p] for p in spec.split(","))


@dataclass
class LayoutInfo:
    block_bytes: int
    chunk_bytes: int
    block_stride: int
    n_chunks: int
    num_blocks: int
    vector_bytes: int


class KvLayout:
    """An engine's paged KV cache (kvp_kv_layout) on a Device.

    ``kind`` "vllm_nhd" (default): ``k`` and ``v`` are lists, one tensor per
    layer, each [num_blocks, block_size, kv_heads, head_dim]; "vllm_hnd":
    [num_blocks, kv_heads, block_size, head_dim]; "vllm_nhd_kv" /
    "vllm_hnd_kv": ``k`` only, [2, ...] per layer; "mla": ``k`` only,
    [num_blocks, block_size, latent_dim] per layer; "cross_layer": ``k`` is
    ONE tensor [num_blocks, layers, 2, block_size, kv_heads, head_dim].
    Every tensor: same shape and dtype (1, 2 or 4 bytes), C-contiguous,
    writable; CUDA tensors on the CUDA backend, host memory on the CPU
    backend.  The layout keeps the tensors alive."""

    def __init__(self, device: Device, k: Any, v: Any = None,
                 kind: str = "vllm_nhd") -> None:
        self._l = None
        if kind not in _KINDS:
            raise ValueError(f"KvLayout: kind {kind!r}: one of {sorted(_KINDS)}")
        code, per_layer, separate, spec = _KINDS[kind]
        ks = list(k) if per_layer else [k]
        vs = list(v) if separate and v is not None else []
        self._check_args(kind, per_layer, separate, ks, v)
        infos = [tensor_info(t, f"k[{i}]") for i, t in enumerate(ks)]
        infos += [tensor_info(t, f"v[{i}]") for i, t in enumerate(vs)]
        dims = self._dims_of(kind, spec, infos[0].shape, len(ks))
        self._validate(device, kind, _dims(spec, dims), infos)
        self._create(device, code, dims, infos, len(ks), separate, per_layer)
        self.device, self.kind, self._keep = device, kind, (ks, vs)
        self.num_layers, self.num_blocks = dims["L"], dims["NB"]
        self.block_size, self.kv_heads, self.head_dim = dims["BS"], dims["H"], dims["D"]
        device._children.add(self)

    @staticmethod
    def _check_args(kind: str, per_layer: bool, separate: bool, ks: list, v: Any) -> None:
        if separate and (v is None or len(list(v)) != len(ks)):
            raise ValueError(f"KvLayout({kind}): one V tensor per K tensor "
                             f"({len(ks)} K, {0 if v is None else len(list(v))} V)")
        if not separate and v is not None:
            raise ValueError(f"KvLayout({kind}): K and V share tensors; pass v=None")
        if per_layer and not ks:
            raise ValueError(f"KvLayout({kind}): no layers")

    @staticmethod
    def _dims_of(kind: str, spec: str, shape: Tuple[int, ...], n: int) -> Dict[str, int]:
        names = spec.split(",")
        if len(shape) != len(names):
            raise ValueError(f"KvLayout({kind}): tensors are [{spec}] "
                             f"({len(names)} dims), got shape {list(shape)}")
        d = {p: shape[i] for i, p in enumerate(names) if not p.isdigit()}
        d.setdefault("L", n)
        d.setdefault("H", 1)
        return d

    @staticmethod
    def _validate(dev: Device, kind: str, want: Tuple[int, ...],
                  infos: List[TensorInfo]) -> None:
        first = infos[0]
        for i, t in enumerate(infos):
            if t.shape != want:
                raise ValueError(f"KvLayout({kind}): tensor {i} has shape "
                                 f"{list(t.shape)}, expected {list(want)}")
            if (t.dtype, t.itemsize) != (first.dtype, first.itemsize):
                raise ValueError(f"KvLayout({kind}): tensor {i} is {t.dtype}, "
                                 f"tensor 0 is {first.dtype}")
            if not t.writable:
                raise ValueError(f"KvLayout({kind}): tensor {i} is read-only")
            if t.on_gpu and dev.backend == "cpu":
                raise ValueError(f"KvLayout({kind}): tensor {i} is on the GPU; the "
                                 "CPU backend takes host memory")
        if first.itemsize not in (1, 2, 4):
            raise ValueError(f"KvLayout({kind}): dtype {first.dtype} has "
                             f"{first.itemsize}-byte elements; need 1, 2 or 4")

    def _create(self, dev: Device, code: int, d: Dict[str, int], infos: List[TensorInfo],
                n_k: int, separate: bool, per_layer: bool) -> None:
        desc = ffi.new("kvp_kv_layout_desc *")
        desc.kind, desc.num_layers, desc.num_blocks = code, d["L"], d["NB"]
        desc.block_size, desc.num_kv_heads, desc.head_dim = d["BS"], d["H"], d["D"]
        desc.elem_size = infos[0].itemsize
        ptrs = [ffi.cast("void *", t.ptr) for t in infos]
        kp = ffi.new("void *[]", ptrs[:n_k])
        vp = ffi.new("void *[]", ptrs[n_k:]) if separate else ffi.NULL
        if per_layer:
            desc.k_layers, desc.v_layers = kp, vp
        else:
            desc.base = ptrs[0]
        out = ffi.new("kvp_kv_layout **")
        dev._check(lib.kvp_kv_layout_create(dev._live(), desc, out),
                   f"KvLayout({_kind_name(code)})")
        self._l = out[0]
        self._owner = Owner(self._l, lib.kvp_kv_layout_destroy, [dev._owner])

    def _live(self) -> Any:
        if self._l is None:
            raise ValueError("KvLayout is closed")
        return self._l

    def info(self) -> LayoutInfo:
        i = ffi.new("kvp_kv_layout_info *")
        check(lib.kvp_kv_layout_info_get(self._live(), i), "KvLayout.info")
        return struct_fields(LayoutInfo, i)

    @property
    def block_bytes(self) -> int:
        """Staging bytes per block: every layer's K then V page, in order."""
        return self.info().block_bytes

    def _xfer(self, ids: Any, buf: Any, slots: Any, method: str, writable: bool,
              unique: bool) -> Tuple[Any, list]:
        if method not in _METHODS:
            raise ValueError(f"method {method!r}: one of {sorted(_METHODS)}")
        arr, n = _u32_array(ids, "block_ids")
        ptr, cap, keep = self._staging(buf, writable)
        x = ffi.new("kvp_xfer *")
        x.layout, x.block_ids, x.n, x.method = self._live(), arr, n, _METHODS[method]
        x.staging, x.staging_bytes = ptr, cap
        x.flags = lib.KVP_XFER_IDS_UNIQUE if unique else 0
        keep = [arr, keep]
        if slots is not None:
            sarr, ns = _u32_array(slots, "slots")
            if ns != n:
                raise ValueError(f"slots: {ns} slots for {n} block ids")
            x.staging_slots = sarr
            keep.append(sarr)
        return x, keep

    def _staging(self, buf: Any, writable: bool) -> tuple:
        if hasattr(buf, "__cuda_array_interface__") or (
                hasattr(buf, "device") and getattr(buf.device, "type", "cpu") != "cpu"):
            t = tensor_info(buf, "staging")
            n = 1
            for s in t.shape:
                n *= s
            return ffi.cast("void *", t.ptr), n * t.itemsize, buf
        return write_buffer(buf) if writable else read_buffer(buf)

    def gather(self, block_ids: Any, out: Any, slots: Any = None, method: str = "auto",
               stream: Optional[Stream] = None, sync: bool = True) -> str:
        """Copy blocks block_ids[i] (all layers) into staging slot i (or
        slots[i]) of ``out``: a host buffer (registered with the device on
        GPU backends) or a device tensor, at least (max slot + 1) *
        block_bytes long.  Returns the method used ("kernel" or
        "copy_engine").  sync=False leaves it queued on ``stream``; keep
        ``out`` alive until that stream is synchronized."""
        x, _keep = self._xfer(block_ids, out, slots, method, True, False)
        rc = self.device._check(lib.kvp_device_gather(self.device._live(),
                                                      _stream_ptr(stream), x),
                                "KvLayout.gather")
        self._sync(stream, sync)
        return _METHOD_NAMES.get(rc, str(rc))

    def scatter(self, block_ids: Any, src: Any, slots: Any = None, method: str = "auto",
                stream: Optional[Stream] = None, sync: bool = True,
                ids_unique: bool = False) -> str:
        """Copy staging slot i (or slots[i]) of ``src`` into block
        block_ids[i] (distinct ids: a repeat raises before anything is
        copied).  As gather otherwise."""
        x, _keep = self._xfer(block_ids, src, slots, method, False, ids_unique)
        rc = self.device._check(lib.kvp_device_scatter(self.device._live(),
                                                       _stream_ptr(stream), x),
                                "KvLayout.scatter")
        self._sync(stream, sync)
        return _METHOD_NAMES.get(rc, str(rc))

    def _sync(self, stream: Optional[Stream], sync: bool) -> None:
        if sync:
            if stream is None:
                self.device.synchronize()
            else:
                stream.synchronize()

    def close(self) -> None:
        if self._l is not None:
            self._l = None
            self._owner.close()

    def __del__(self) -> None:
        self.close()


def _c_contiguous(t: Any) -> bool:
    c = getattr(t, "is_contiguous", None)
    return bool(c()) if callable(c) else bool(t.flags.c_contiguous)


def vllm_kv_layout(device: Device, kv_caches: Dict[str, Any], num_blocks: Optional[int],
                   block_size: int) -> Tuple[KvLayout, str]:
    """The KvLayout of a vLLM worker's paged KV cache (``register_kv_caches``'
    {layer: tensor}), and a tag for the layout (block shape, no block count)
    that keys kvtier's namespace, so blocks saved in one layout are never
    read into another.  Two shapes: FlashAttention's K and V planes,
    [2, num_blocks, block_size, kv_heads, head_dim] ("vllm_nhd_kv": a block
    is two runs, gathered into one slot); and any layout whose first
    dimension is the block (the CPU backend's [num_blocks, kv_heads,
    block_size, 2 * head_dim], FlashInfer's [num_blocks, 2, ...], MLA): each
    block one contiguous run, moved whole as [block_size, rest] rows.
    Anything else raises ValueError naming the layer and its shape."""
    items = list(kv_caches.items())
    if not items:
        raise ValueError("kvplane.vllm: no KV cache tensors")
    for name, t in items:
        if not _c_contiguous(t):
            strides = list(t.stride()) if callable(getattr(t, "stride", None)) else "?"
            raise ValueError(f"kvplane.vllm: layer {name}'s KV cache is not contiguous "
                             f"(shape {list(t.shape)}, strides {strides}); the connector "
                             "moves whole contiguous blocks")
    shape = tuple(items[0][1].shape)
    if (num_blocks is not None and len(shape) == 5 and shape[:3] == (2, num_blocks,
                                                                     block_size)):
        for name, t in items:
            if tuple(t.shape) != shape:
                raise ValueError(f"kvplane.vllm: layer {name}'s KV cache has shape "
                                 f"{list(t.shape)}, layer {items[0][0]}'s {list(shape)}")
        tag = "kv2:" + "x".join(str(d) for d in shape[2:])
        return KvLayout(device, [t for _, t in items], kind="vllm_nhd_kv"), tag
    views, shapes = [], set()
    for name, t in items:
        if num_blocks is not None and t.shape[0] != num_blocks:
            raise ValueError(f"kvplane.vllm: layer {name}'s KV cache has shape "
                             f"{list(t.shape)}: neither blocks first ({num_blocks} "
                             f"blocks) nor FlashAttention's [2, {num_blocks}, "
                             f"{block_size}, heads, head_dim], a layout this adapter "
                             "does not move yet")
        per_block = 1
        for d in t.shape[1:]:
            per_block *= int(d)
        if per_block % block_size:
            raise ValueError(f"kvplane.vllm: layer {name}: {per_block} elements a "
                             f"block, not a multiple of block size {block_size}")
        views.append(t.reshape(t.shape[0], block_size, per_block // block_size))
        shapes.add("x".join(str(d) for d in t.shape[1:]))
    return KvLayout(device, views, kind="mla"), ",".join(sorted(shapes))


def _kind_name(code: int) -> str:
    return next((k for k, v in _KINDS.items() if v[0] == code), str(code))


@dataclass
class TierLinkStats:
    saves: int
    loads: int
    blocks_saved: int
    blocks_save_failed: int
    blocks_loaded: int
    blocks_missed: int
    wrong_length: int
    gathers: int
    scatters: int
    blocks_direct: int
    blocks_saved_direct: int
    rounds_overlapped: int


class TierLink:
    """kvp_tier_link: saves an engine's cache blocks into a TierStore under
    block keys and loads them back into any block ids, through the
    device's gather/scatter.  ``ns`` must be added to the store first
    (``store.add_namespace(ns, block_bytes=layout.block_bytes)`` gives it
    fixed DRAM slots: with a store created with ``device=`` the blocks then
    go straight between the cache and the DRAM slots).  Thread-safe (calls
    on one link are serialised)."""

    def __init__(self, store: TierStore, device: Device, layout: KvLayout, ns: Namespace,
                 staging_blocks: int = 0) -> None:
        self._k = None
        o = ffi.new("kvp_tier_link_opts *")
        o.staging_blocks = staging_blocks
        out = ffi.new("kvp_tier_link **")
        device._check(lib.kvp_tier_link_create(store._live(), device._live(),
                                               layout._live(), ns._ns, o, ffi.NULL, out),
                      "TierLink")
        self._k = out[0]
        self._owner = Owner(self._k, lib.kvp_tier_link_destroy,
                            [store._owner, device._owner, layout._owner])
        self.store, self.device, self.layout, self.ns = store, device, layout, ns
        device._children.add(self)
        store._links.add(self)

    def _live(self) -> Any:
        if self._k is None:
            raise ValueError("TierLink is closed")
        return self._k

    def _args(self, keys: KeysLike, block_ids: Any) -> tuple:
        k = as_keys(keys)
        ids, n = _u32_array(block_ids, "block_ids")
        if n != len(k):
            raise ValueError(f"TierLink: {len(k)} keys for {n} block ids")
        return k, ids, n, ffi.new("int[]", max(n, 1))

    def save(self, keys: KeysLike, block_ids: Any,
             cls: ClassLike = StabilityClass.VOLATILE, durable: bool = False,
             stream: Optional[Stream] = None) -> List[int]:
        """Save cache blocks block_ids[i] under keys[i] (the prompt's
        chained block keys).  Returns per-block results: 1 stored (or
        already there), else a negative code.  The blocks are in the store
        when it returns."""
        k, ids, n, res = self._args(keys, block_ids)
        po = ffi.new("kvp_tier_put_opts *")
        po.cls = class_of(cls)
        po.flags = lib.KVP_TIER_PUT_DURABLE if durable else 0
        self.device._check(lib.kvp_tier_save(self._live(), _stream_ptr(stream), k.ptr,
                                             ids, n, po, res), "TierLink.save")
        return [int(res[i]) for i in range(n)]

    def load(self, keys: KeysLike, block_ids: Any,
             stream: Optional[Stream] = None) -> List[Optional[Tier]]:
        """Load keys[i] into cache block block_ids[i] (distinct ids).  Per
        block: the tier it came from, or None (a miss: the block was not
        written -- recompute it; a prefix user stops at the first None)."""
        k, ids, n, res = self._args(keys, block_ids)
        self.device._check(lib.kvp_tier_load(self._live(), _stream_ptr(stream), k.ptr,
                                             ids, n, res), "TierLink.load")
        return [Tier(int(res[i])) if res[i] >= 0 else None for i in range(n)]

    def stats(self) -> TierLinkStats:
        s = ffi.new("kvp_tier_link_stats *")
        check(lib.kvp_tier_link_stats_get(self._live(), s), "TierLink.stats")
        return struct_fields(TierLinkStats, s)

    def close(self) -> None:
        if self._k is not None:
            self._k = None
            self._owner.close()

    def __del__(self) -> None:
        self.close()

    def __enter__(self) -> "TierLink":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
