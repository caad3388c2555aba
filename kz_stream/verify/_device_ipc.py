"""Device memory one process hands to another without a trip through the host: CUDA's
IPC memory handles (``cuIpcGetMemHandle``), through the driver API.

Why: a candidate's outputs now travel worker → host (a sealed memory file) → the
verifier's device for comparison, a few seconds per output for KernelBench's 6-8 GiB
ones (``docs/verifier.md``, "Seventh GPU run of the mix"). A worker that exports its
output and a verifier that opens it on the same device would copy it once, device to
device. ``benchmarks/bench_device_ipc.py`` measures both ways, inside the workers'
boundary (their own PID, IPC and mount namespaces) and without it.

Written against the driver API with ctypes because torch's own sharing of CUDA tensors
(``torch.multiprocessing``) keeps a reference count in a file under ``/dev/shm``, which a
jailed worker has to itself; a 64-byte handle and an offset need nothing beside them.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Any

import torch


class DeviceIpcError(RuntimeError):
    """A driver call for CUDA IPC failed (the message names the call and the code)."""


class _Handle(ctypes.Structure):
    # Bytes, not c_char: a c_char array reads back only up to its first zero byte.
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


_driver: ctypes.CDLL | None = None


def _cuda() -> ctypes.CDLL:
    global _driver
    if _driver is None:
        try:
            _driver = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DeviceIpcError(f"no CUDA driver library: {e}") from e
    return _driver


def _check(call: str, code: int) -> None:
    if code:
        text = ctypes.c_char_p()
        _cuda().cuGetErrorString(code, ctypes.byref(text))
        name = text.value.decode() if text.value else "unknown"
        raise DeviceIpcError(f"{call} failed: {name} ({code})")


def _symbol(name: str) -> Any:
    lib = _cuda()
    return getattr(lib, f"{name}_v2", None) or getattr(lib, name)


# Device index -> its primary context, retained once for the life of this process.
_contexts: dict[int, ctypes.c_void_p] = {}


def _make_current(index: int) -> None:
    """Makes device ``index``'s primary context (the one torch uses) current on this
    thread, for the driver calls that follow, creating it if no CUDA call has yet. On an
    H100 (2026-12-07) ``cuIpcOpenMemHandle`` failed in a verifier thread with "invalid
    device context": neither ``torch.cuda.device`` (no runtime call when the device is
    the thread's default already) nor an allocation the caching allocator serves makes it
    current. The context is retained and never released: released at once, a context
    this call had created was destroyed ("context is destroyed", the next try)."""
    cu = _cuda()
    ctx = _contexts.get(index)
    if ctx is None:
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        _check("cuInit", cu.cuInit(0))  # a no-op once torch has used the device
        _check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), index))
        _check("cuDevicePrimaryCtxRetain",
               cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
        _contexts[index] = ctx
    _check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))


@dataclass(frozen=True)
class Exported:
    """What the other process needs to open a tensor: the allocation's handle, the
    tensor's offset in it, and its dtype and shape (contiguous)."""

    handle: bytes
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def __reduce__(self) -> tuple[Any, ...]:
        # The class and its fields alone: a reply's unpickler allows this class and no
        # generic object constructor (``_ipc._REPLY_GLOBALS``).
        return (Exported, (self.handle, self.offset, self.nbytes, self.dtype, self.shape))


def export(t: torch.Tensor) -> Exported:
    """A handle to contiguous CUDA tensor ``t``'s memory; ``t`` must outlive its use."""
    if not t.is_cuda or not t.is_contiguous():
        raise ValueError("only a contiguous CUDA tensor can be exported")
    torch.cuda.synchronize(t.device)
    ptr = ctypes.c_uint64(t.data_ptr())
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    _check("cuMemGetAddressRange", _symbol("cuMemGetAddressRange")(
        ctypes.byref(base), ctypes.byref(size), ptr))
    handle = _Handle()
    _check("cuIpcGetMemHandle", _cuda().cuIpcGetMemHandle(ctypes.byref(handle), base))
    return Exported(bytes(handle.reserved), ptr.value - base.value,
                    t.numel() * t.element_size(), str(t.dtype).removeprefix("torch."),
                    tuple(t.shape))


def _dtype(e: Exported) -> torch.dtype:
    """The torch dtype an export names, and a shape of non-negative ints, or ValueError:
    an export comes from another process, so a name is looked up only among dtypes."""
    dtype = getattr(torch, e.dtype, None) if isinstance(e.dtype, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{e.dtype!r} is not a torch dtype")
    if not isinstance(e.shape, tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in e.shape):
        raise ValueError(f"{e.shape!r} is not a shape")
    return dtype


def opened_copies(value: Any, device: torch.device | str) -> tuple[Any, int]:
    """``value`` (a reply, with lists, tuples and dicts in it) with each ``Exported``
    replaced by a copy on ``device`` of the memory it names (opened, copied device to
    device, closed), and how many there were. The exporter must keep that memory until
    this returns."""
    if isinstance(value, Exported):
        opened = Opened(value, device)
        try:
            copy = opened.tensor.clone()
            torch.cuda.current_stream(copy.device).synchronize()  # read before it unmaps
            return copy, 1
        finally:
            opened.close()
    items: list[tuple[Any, int]]
    if isinstance(value, list | tuple):
        items = [opened_copies(v, device) for v in value]
        return type(value)(v for v, _ in items), sum(n for _, n in items)
    if isinstance(value, dict):
        items = [opened_copies(v, device) for v in value.values()]
        return ({k: v for k, (v, _) in zip(value, items, strict=True)},
                sum(n for _, n in items))
    return value, 0


class _DeviceBuffer:
    """Raw device bytes in the form ``torch.as_tensor`` takes without copying."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None,
                                         "version": 3}


class Opened:
    """An exported tensor opened in this process: ``tensor`` views the exporter's memory
    (valid until ``close``)."""

    def __init__(self, e: Exported, device: torch.device | str = "cuda") -> None:
        # What an exporter says is checked before anything reads its memory: a read past
        # the allocation would fault this process's own CUDA context.
        if len(e.handle) != 64:
            raise ValueError(f"a CUDA IPC handle has 64 bytes, not {len(e.handle)}")
        if e.offset < 0 or e.nbytes < 0:
            raise ValueError(f"offset {e.offset} and size {e.nbytes} cannot be negative")
        dtype = _dtype(e)
        if e.offset % dtype.itemsize or e.nbytes != math.prod(e.shape) * dtype.itemsize:
            raise ValueError(f"{e.nbytes} bytes at offset {e.offset} are not a {e.dtype} "
                             f"tensor of shape {e.shape}")
        dev = torch.device(device)
        self._base = ctypes.c_uint64()
        with torch.cuda.device(dev):
            _make_current(dev.index if dev.index is not None else torch.cuda.current_device())
            handle = _Handle.from_buffer_copy(e.handle)
            _check("cuIpcOpenMemHandle", _symbol("cuIpcOpenMemHandle")(
                ctypes.byref(self._base), handle, ctypes.c_uint(1)))  # lazy peer access
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            _check("cuMemGetAddressRange", _symbol("cuMemGetAddressRange")(
                ctypes.byref(base), ctypes.byref(size), self._base))
            if e.offset + e.nbytes > base.value + size.value - self._base.value:
                _cuda().cuIpcCloseMemHandle(self._base)
                self._base = ctypes.c_uint64()
                raise ValueError(f"{e.nbytes} bytes at offset {e.offset} lie past the "
                                 f"exported allocation's {size.value}")
            raw = torch.as_tensor(_DeviceBuffer(self._base.value + e.offset, e.nbytes),
                                  device=dev)
        self.tensor = raw.view(dtype).view(e.shape)

    def close(self) -> None:
        if self._base.value:
            del self.tensor
            _check("cuIpcCloseMemHandle", _cuda().cuIpcCloseMemHandle(self._base))
            self._base = ctypes.c_uint64()
