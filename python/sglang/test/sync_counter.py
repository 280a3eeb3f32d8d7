"""Counts the calls that cross between host and device, on any device (CPU included).

On a GPU each device->host read stalls the host until the GPU catches up, and so does each
host->device copy from pageable memory. On CPU nothing stalls, but the same calls happen, so
counting them on CPU shows what a GPU would pay.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

# Tensor methods that hand a tensor's values to the host (a sync on a GPU).
_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}


def _kind(name: str, args: tuple, kwargs: dict) -> str | None:
    if name in _READS:
        return "read"
    if name == "to" and any(isinstance(a, (str, torch.device)) for a in (*args[1:], kwargs.get("device"))):
        return "transfer"
    if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
        return "upload"
    if name == "__getitem__" and isinstance(args[1], list):  # the index list is uploaded
        return "upload"
    return None


class SyncCounter(TorchFunctionMode):
    """Calls seen while active, by kind:
    reads: device->host reads (`.tolist()`, `.item()`, `bool(t)`, ...);
    transfers: `.to(device)` (either way: on CPU host and device look alike);
    uploads: tensors made from host data on a named device (`torch.tensor(x, device=d)`) and
    indexing with a Python list.
    With trace, `sites` counts them per kind and call site."""

    def __init__(self, trace: bool = False):
        super().__init__()
        self.calls: Counter = Counter()
        self.trace = trace
        self.sites: Counter = Counter()

    @property
    def reads(self) -> int:
        return self.calls["read"]

    @property
    def transfers(self) -> int:
        return self.calls["transfer"]

    @property
    def uploads(self) -> int:
        return self.calls["upload"]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        kind = _kind(name, args, kwargs)
        if kind is not None:
            self.calls[kind] += 1
            if self.trace:
                self.sites[f"{kind} {name} @ {_site()}"] += 1
        return func(*args, **kwargs)


def _site() -> str:
    """The innermost sglang frame and, when a helper in another file called it, the caller."""
    frames = [f for f in traceback.extract_stack() if "/sglang/" in f.filename and "sync_counter" not in f.filename]
    if not frames:
        return "?"
    callers = [f for f in frames if f.filename != frames[-1].filename]
    return " < ".join(f"{f.filename.split('/sglang/')[-1]}:{f.lineno}" for f in [frames[-1], *callers[-1:]])
