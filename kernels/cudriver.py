"""The CUDA driver's batched copy, ``cuMemcpyBatchAsync``, through ``ctypes`` on ``libcuda``.

One driver call enqueues a whole job's copies (:class:`~kernels.descriptors.Descriptors`) on a
stream; the DMA engines run them. This is what vLLM 0.33.0's ``swap_blocks_batch`` does on
CUDA 12.8 and later (``vllm/_custom_ops.py:3039-3065``), so a job copied this way is
measured against the op vLLM itself runs. No dependency beyond the driver library that any
CUDA machine has; without it (this CPU machine), :func:`batch_copy` is ``None`` and
:func:`unavailable_reason` says why.

Two exported forms exist. The CUDA 12.8 symbol ``cuMemcpyBatchAsync`` takes a ``failIdx``
out-argument; CUDA 13.0 headers map the name to ``cuMemcpyBatchAsync_v2``, which does not. A
13.x driver exports both; the newer one is taken when present.

Source access order (``CUmemcpySrcAccessOrder``): a store reads the live GPU KV cache, which
the compute stream keeps writing, so its reads stay in stream order (``STREAM``); a load reads
host memory that no GPU stream writes while the load is in flight, so the driver may read it
in any order (``ANY``) and pipeline the reads, as vLLM's worker chooses
(``vllm/v1/kv_offload/cpu/gpu_worker.py:700-706``). The caller picks per call.

The descriptor arrays are host memory that the driver reads at the call; since the lifetime
it needs them for is not documented, the engine keeps them with the job until it completes
(vLLM's worker does the same).

``KVSPEC_BATCH_DMA=0`` in the environment switches the batched copy off.
"""

from __future__ import annotations

import ctypes
import enum
import functools
import os

from kernels.descriptors import Descriptors

__all__ = [
    "MIN_DRIVER_VERSION",
    "BatchCopy",
    "CUmemLocation",
    "CUmemcpyAttributes",
    "CudaDriverError",
    "DriverUnavailable",
    "SrcAccessOrder",
    "batch_copy",
    "load",
    "unavailable_reason",
]

MIN_DRIVER_VERSION = 12080
"""``cuMemcpyBatchAsync`` first shipped with the CUDA 12.8 driver."""

_LIBRARY = "libcuda.so.1"


class SrcAccessOrder(enum.IntEnum):
    """``CUmemcpySrcAccessOrder`` (``cuda.h``)."""

    STREAM = 0x1
    DURING_API_CALL = 0x2
    ANY = 0x3


class _LocationType(enum.IntEnum):
    """``CUmemLocationType`` (``cuda.h``): the members a hint uses."""

    INVALID = 0x0
    DEVICE = 0x1
    HOST = 0x2


class CUmemLocation(ctypes.Structure):
    """``CUmemLocation_v1``: a location type and an id (a device ordinal for ``DEVICE``)."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemcpyAttributes(ctypes.Structure):
    """``CUmemcpyAttributes_v1``: the attributes of a range of a batch's copies."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", CUmemLocation),
                ("dstLocHint", CUmemLocation), ("flags", ctypes.c_uint)]


class CudaDriverError(RuntimeError):
    """A driver call failed; the message names the call, the ``CUresult`` and the batch."""


class BatchCopy:
    """The loaded ``cuMemcpyBatchAsync``: :meth:`__call__` enqueues one batch on a stream."""

    def __init__(self, lib: ctypes.CDLL, version: int) -> None:
        self._lib = lib
        self.driver_version = version
        self.symbol = ("cuMemcpyBatchAsync_v2" if hasattr(lib, "cuMemcpyBatchAsync_v2")
                       else "cuMemcpyBatchAsync")
        self.takes_fail_index = self.symbol == "cuMemcpyBatchAsync"
        fn = getattr(lib, self.symbol)
        fn.restype = ctypes.c_int
        size_p = ctypes.POINTER(ctypes.c_size_t)
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.POINTER(CUmemcpyAttributes), size_p, ctypes.c_size_t,
                       *([size_p] if self.takes_fail_index else []), ctypes.c_void_p]
        self._fn = fn
        self._attrs_index = (ctypes.c_size_t * 1)(0)  # one attribute set, from copy 0
        lib.cuGetErrorName.restype = ctypes.c_int
        lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]

    def error_name(self, code: int) -> str:
        name = ctypes.c_char_p()
        if self._lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or name.value is None:
            return f"CUresult {code}"
        return name.value.decode()

    @staticmethod
    def attributes(order: SrcAccessOrder, device: int, store: bool) -> CUmemcpyAttributes:
        """One attribute set for a job: the source order, and location hints (GPU ``device``
        and the host; the driver ignores them for memory it did not allocate as managed)."""
        gpu = CUmemLocation(_LocationType.DEVICE, device)
        host = CUmemLocation(_LocationType.HOST, 0)
        src, dst = (gpu, host) if store else (host, gpu)
        return CUmemcpyAttributes(int(order), src, dst, 0)

    def __call__(self, batch: Descriptors, stream: int, attrs: CUmemcpyAttributes) -> None:
        """Enqueue ``batch`` on the stream whose ``CUstream`` handle is ``stream`` (never the
        legacy null stream). Raises :class:`CudaDriverError` (nothing was enqueued then,
        except copies before the failing index where the driver reports one)."""
        if stream == 0:
            raise CudaDriverError("cuMemcpyBatchAsync needs a stream other than the legacy "
                                  "null stream")
        count = batch.count
        tail: list[object] = []
        fail = ctypes.c_size_t(count)
        if self.takes_fail_index:
            tail.append(ctypes.byref(fail))
        code = self._fn(batch.dst.data_ptr(), batch.src.data_ptr(), batch.sizes.data_ptr(),
                        count, ctypes.byref(attrs), self._attrs_index, 1, *tail,
                        ctypes.c_void_p(stream))
        if code != 0:
            where = f" at copy {fail.value}" if fail.value < count else ""
            first = (f"; copy 0: {int(batch.sizes[0])} bytes {int(batch.src[0]):#x} -> "
                     f"{int(batch.dst[0]):#x}") if count else ""
            raise CudaDriverError(
                f"{self.symbol} failed with {self.error_name(code)}{where}: a batch of {count} "
                f"copies, {batch.nbytes} bytes{first}")


class DriverUnavailable(RuntimeError):
    """No usable ``cuMemcpyBatchAsync`` in a driver library; the message says why."""


def load(library: str = _LIBRARY) -> BatchCopy:
    """The batched copy of the driver library ``library`` (a path or a name the dynamic
    loader finds); raises :class:`DriverUnavailable` saying why it cannot be used."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as exc:
        raise DriverUnavailable(f"no CUDA driver library ({exc})") from None
    version = ctypes.c_int(0)
    lib.cuDriverGetVersion.restype = ctypes.c_int
    lib.cuDriverGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    if lib.cuDriverGetVersion(ctypes.byref(version)) != 0:
        raise DriverUnavailable(f"cuDriverGetVersion failed in {library}")
    if version.value < MIN_DRIVER_VERSION:
        raise DriverUnavailable(
            f"the CUDA driver is version {version.value}; cuMemcpyBatchAsync needs "
            f"{MIN_DRIVER_VERSION} (CUDA 12.8)")
    if not (hasattr(lib, "cuMemcpyBatchAsync_v2") or hasattr(lib, "cuMemcpyBatchAsync")):
        raise DriverUnavailable(f"{library} exports no cuMemcpyBatchAsync")
    return BatchCopy(lib, version.value)


_reason = ""


@functools.cache
def _default() -> BatchCopy | None:
    global _reason
    if os.environ.get("KVSPEC_BATCH_DMA", "1") == "0":
        _reason = "switched off by KVSPEC_BATCH_DMA=0"
        return None
    try:
        return load()
    except DriverUnavailable as exc:
        _reason = str(exc)
        return None


def batch_copy() -> BatchCopy | None:
    """The system driver's batched copy, loaded once; ``None`` where it is unavailable."""
    return _default()


def unavailable_reason() -> str:
    """Why :func:`batch_copy` is ``None`` (empty when it is available)."""
    _default()
    return _reason
