"""All-reduce and all-gather among the processes of one node through buffers that each rank
allocates once and every other rank maps, synchronised by flags in those buffers.

The same code serves ranks on different GPUs of one node (CUDA IPC, peer access over NVLink
or PCIe) and ranks that share one GPU (which NCCL refuses). On CPU the buffers are files in
shared memory and the kernels run under Triton's interpreter (tests of the protocol). Each
collective is three launches on the caller's stream, all capturable in a CUDA graph:
1. copy the input into this rank's data slot (slot = sequence number % 2);
2. one program signals every rank (its flag in their buffers = the sequence number) and spins
   until every rank has signalled the same number, then counts the collective;
3. read every rank's slot: the sum in rank order (all-reduce) or the concatenation (all-gather).

Two slots make one barrier per collective enough: a rank overwrites slot s in collective
e + 2 only after passing collective e + 1's barrier, which every peer reaches only after
finishing collective e's reads (its launches are ordered on one stream).

Kernels of processes that share one GPU are time-sliced: a spinning program holds its slice
until the GPU switches context, so a collective there costs about one slice per rank
(milliseconds), and it cannot deadlock as long as every rank issues the same collectives in
the same order (the engine's invariant under DP attention).

Buffer layout (bytes): [0, 512) flags, int64 per rank; [512, 520) this rank's counter;
[1024, 1024 + 2 * slot_bytes) the two data slots.
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from typing import Any

import torch
import torch.distributed as dist

from sglang.srt.utils.int_math import cdiv

logger = logging.getLogger(__name__)

MAX_WORLD = 64
_DATA_OFFSET = 1024  # bytes: flags and counter before it, slots 1 KiB-aligned after it
_BLOCK = 2048  # elements per program of the copy and read kernels


class MessageTooLarge(RuntimeError):
    pass


class IpcCommunicator:
    """Collectives over the `world` ranks of `cpu_group` (a gloo group of processes on one
    node); every rank constructs it collectively. slot_bytes is the largest message: the tensor
    of an all-reduce, one rank's part of an all-gather."""

    def __init__(self, rank: int, world: int, slot_bytes: int, device: torch.device, cpu_group: Any):
        if not 1 < world <= MAX_WORLD:
            raise ValueError(f"IPC collectives need 2..{MAX_WORLD} ranks, got {world}")
        from sglang.srt.distributed import ipc_kernels  # triton: only where the collectives run

        self.kernels = ipc_kernels
        self.rank, self.world = rank, world
        self.slot_bytes = cdiv(max(slot_bytes, 1), 1024) * 1024
        self.device = torch.device(device)
        total = _DATA_OFFSET + 2 * self.slot_bytes
        open_buffers = _open_cuda_buffers if self.device.type == "cuda" else _open_shm_buffers
        self.local, self.mapped = open_buffers(total, self.device, rank, world, cpu_group)
        self.counter = self.local[:_DATA_OFFSET].view(torch.int64)[MAX_WORLD : MAX_WORLD + 1]
        addresses = [b.data_ptr() for b in self.mapped]
        self.flag_table = torch.tensor(addresses, dtype=torch.int64, device=self.device)
        self.data_table = torch.tensor([a + _DATA_OFFSET for a in addresses], dtype=torch.int64, device=self.device)
        logger.info(
            "IPC collectives: rank %d of %d, %.2f MiB per data slot on %s",
            rank,
            world,
            self.slot_bytes / (1 << 20),
            self.device,
        )

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def check_fits(self, x: torch.Tensor, what: str) -> None:
        if not self.fits(x):
            raise MessageTooLarge(
                f"{what} of {x.numel() * x.element_size()} bytes {tuple(x.shape)} exceeds the IPC "
                f"collective buffer's {self.slot_bytes} bytes per slot (--custom-collective-buffer-mb)"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the same bits."""
        self.check_fits(x, "all-reduce")
        if x.numel() == 0:  # the same size on every rank: all of them skip it
            return x
        flat = x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
        n, slot_elems = flat.numel(), self.slot_bytes // flat.element_size()
        self._exchange(flat, slot_elems)
        self.kernels.reduce_out_kernel[(cdiv(n, _BLOCK),)](
            self.data_table, self.counter, flat, n, slot_elems, WORLD=self.world, BLOCK=_BLOCK
        )
        if flat.data_ptr() != x.data_ptr():
            x.copy_(flat.view(x.shape))
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        self.check_fits(x, "all-gather part")
        parts = torch.empty((self.world, *x.shape), dtype=x.dtype, device=x.device)
        if x.numel() > 0:
            flat = x.contiguous().view(-1)
            n, slot_elems = flat.numel(), self.slot_bytes // flat.element_size()
            self._exchange(flat, slot_elems)
            self.kernels.gather_out_kernel[(cdiv(n, _BLOCK),)](
                self.data_table, self.counter, parts, n, slot_elems, WORLD=self.world, BLOCK=_BLOCK
            )
        return torch.cat(parts.unbind(0), dim=dim)

    def _exchange(self, flat: torch.Tensor, slot_elems: int) -> None:
        """Launches 1 and 2: flat into this rank's slot, then the barrier."""
        n = flat.numel()
        self.kernels.copy_in_kernel[(cdiv(n, _BLOCK),)](
            flat, self.data_table, self.counter, n, slot_elems, self.rank, BLOCK=_BLOCK
        )
        self.kernels.signal_and_wait_kernel[(1,)](self.flag_table, self.counter, self.rank, WORLD=self.world, num_warps=1)


def _open_cuda_buffers(total: int, device: torch.device, rank: int, world: int, cpu_group: Any) -> tuple[torch.Tensor, list]:
    """This rank's zeroed buffer, and every rank's mapped here (CUDA IPC handles from
    torch.multiprocessing's reductions, exchanged over the gloo group)."""
    from torch.multiprocessing.reductions import reduce_tensor

    local = torch.zeros(total, dtype=torch.uint8, device=device)
    torch.cuda.synchronize(device)  # zeroed before any peer maps it
    handles = _all_gather_object(reduce_tensor(local), world, cpu_group)
    mapped = [local if p == rank else rebuild(*args) for p, (rebuild, args) in enumerate(handles)]
    _all_gather_object(None, world, cpu_group)  # every rank has mapped every buffer
    return local, mapped


def _open_shm_buffers(total: int, device: torch.device, rank: int, world: int, cpu_group: Any) -> tuple[torch.Tensor, list]:
    """CPU: one file in shared memory per rank, mapped by every rank, unlinked once all have."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(shm, f"sglang-ipc-{uuid.uuid4().hex}")
    local = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    local.zero_()
    paths = _all_gather_object(path, world, cpu_group)
    mapped = [local if p == rank else torch.from_file(q, shared=True, size=total, dtype=torch.uint8) for p, q in enumerate(paths)]
    _all_gather_object(None, world, cpu_group)
    os.unlink(path)
    return local, mapped


def _all_gather_object(obj: Any, world: int, cpu_group: Any) -> list:
    out: list = [None] * world
    dist.all_gather_object(out, obj, group=cpu_group)
    return out
