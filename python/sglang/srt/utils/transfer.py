"""Host<->device copies that stall the host at most once per step.

On CUDA, a copy from pageable host memory and every read of device values wait until the
GPU has finished all queued work, so the host can never run ahead of the GPU. Uploads here
go through pinned memory without waiting (the caching host allocator keeps a pinned block
until the copy that reads it is done, so the host tensor may be dropped at once); reads of
several tensors share one wait.
"""

from __future__ import annotations

import array
import functools
import itertools
from collections.abc import Sequence

import torch


def _is_cuda(device: str | torch.device) -> bool:
    return str(device).startswith("cuda")


def to_device(host: torch.Tensor, device: str | torch.device) -> torch.Tensor:
    """A host tensor on `device` (on CUDA: copied from pinned memory, without waiting); a
    tensor already there is returned as it is."""
    if not _is_cuda(device) or host.is_cuda:
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


_ALIGN_BYTES = 16
_ARRAY_TYPECODES = {torch.int64: "q", torch.float32: "f"}


def _host_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a flat list (through array.array: 3-4x faster than torch.tensor)."""
    code = _ARRAY_TYPECODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array.array(code, values), dtype=dtype)


@functools.cache
def _zeros(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


def upload(
    values: Sequence[Sequence[int | float]],
    device: str | torch.device,
    dtype: torch.dtype = torch.int64,
    tensors: Sequence[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """One device tensor per host list, then per 1-D host tensor of `tensors` (of `dtype`),
    all through a single copy (views of one buffer, each starting on a 16-byte boundary:
    Triton specializes a kernel on whether a pointer is 16-byte aligned, and views at
    offsets that follow the batch's sizes would compile new kernel variants while serving)."""
    step = _ALIGN_BYTES // dtype.itemsize
    sizes = [len(v) for v in values] + [t.shape[0] for t in tensors]
    pads = [-n % step for n in sizes]
    flat: list = []
    for v, pad in zip(values, pads):
        flat.extend(v)
        flat.extend(itertools.repeat(0, pad))
    parts = [_host_tensor(flat, dtype)]
    for t, pad in zip(tensors, pads[len(values) :]):
        parts += [t, _zeros(pad, dtype)] if pad else [t]
    host = torch.empty(sum(sizes) + sum(pads), dtype=dtype, pin_memory=_is_cuda(device))
    torch.cat(parts, out=host)
    dev = to_device(host, device)
    starts = itertools.accumulate((n + pad for n, pad in zip(sizes, pads)), initial=0)
    return [dev.narrow(0, start, n) for start, n in zip(starts, sizes)]


class HostCopy:
    """Device tensors on their way into pinned host memory: queued without waiting, so the
    host can go on (e.g. schedule the next step); `lists()` waits once for all of them.
    The values are those the tensors hold when the copy is queued (a tensor may be a view of
    a buffer that later work rewrites)."""

    def __init__(self, *tensors: torch.Tensor):
        self._done: torch.cuda.Event | None = None
        if any(t.is_cuda for t in tensors):
            tensors = tuple(t.to("cpu", non_blocking=True) for t in tensors)  # into pinned memory
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            tensors = tuple(t.clone() for t in tensors)
        self._tensors = tensors

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The values as host tensors."""
        if self._done is not None:
            self._done.synchronize()
        return self._tensors

    def lists(self) -> list:
        """The values as (nested) lists."""
        return [t.tolist() for t in self.tensors()]


def to_host(*tensors: torch.Tensor) -> list:
    """The tensors' values as (nested) lists, waiting for the device once for all of them."""
    return HostCopy(*tensors).lists()
