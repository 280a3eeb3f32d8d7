"""Request->token table, KV slot allocator and per-layer KV pools.

Slot 0 of every KV pool is reserved as the dummy slot that padded rows write to; the
allocator never hands it out. Likewise row 0 of the request->token table is the dummy row
of padded requests (a captured decode cycle reads and writes it); no request gets it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np
import torch

from sglang.srt.utils.device_constants import DeviceConstants
from sglang.srt.utils.transfer import upload

DUMMY_KV_SLOT = 0
DUMMY_REQ_ROW = 0


class ReqToTokenPool:
    """Maps (request row, position) -> KV slot. One row per running request (rows 1..size),
    and the dummy row 0 (all dummy slots, as long as padded requests write only those)."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int64, device=device)
        self.free_slots = list(range(DUMMY_REQ_ROW + 1, size + 1))
        self.constants = DeviceConstants(device)

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, row: int) -> None:
        self.free_slots.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + len(slots)] = slots

    def span_index(self, rows: list[int], starts: list[int], counts: list[int]) -> torch.Tensor:
        """Flat table index (host) of positions starts[i] : starts[i] + counts[i] of rows[i],
        span after span."""
        n = np.asarray(counts, dtype=np.int64)
        first = np.asarray(rows, dtype=np.int64) * self.max_context_len + np.asarray(starts, dtype=np.int64)
        # Each position: its span's first index + its offset in the span.
        return torch.from_numpy(np.arange(n.sum()) + np.repeat(first - (np.cumsum(n) - n), n))

    def write_at(self, index: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token.view(-1)[index] = slots (both on the table's device; index unique)."""
        self.req_to_token.view(-1).index_copy_(0, index, slots)

    def write_rows_from(self, rows: torch.Tensor, starts: torch.Tensor, slots: torch.Tensor) -> None:
        """req_to_token[rows[i], starts[i] : starts[i] + w] = slots[i] for slots [bs, w], all on
        the table's device (starts need not have reached the host). On CUDA one launch."""
        if not self.req_to_token.is_cuda:
            offsets = self.constants.arange(slots.shape[1])
            self.req_to_token[rows.view(-1, 1), starts.view(-1, 1) + offsets] = slots
            return
        from sglang.srt.kernels.spec_ops import write_table_rows  # triton ships with CUDA builds of torch

        write_table_rows(self.req_to_token, rows, starts, slots)

    def write_spans(self, rows: list[int], starts: list[int], counts: list[int], slots: torch.Tensor) -> torch.Tensor:
        """req_to_token[rows[i], starts[i] : starts[i] + counts[i]] = the next counts[i] of
        `slots` (host), for every i, through one upload; returns the slots on the device."""
        index = self.span_index(rows, starts, counts)
        dev_index, dev_slots = upload([], self.req_to_token.device, tensors=[index, slots])
        self.write_at(dev_index, dev_slots)
        return dev_slots


@dataclass
class TableWrite:
    """New entries of the request->token table, kept on the host until the upload of the batch
    that uses them: then `pool.write_at(index, slots)` with the device copies."""

    pool: ReqToTokenPool
    index: list[int]  # flat table positions
    slots: torch.Tensor  # KV slots (host)


class TokenToKVPoolAllocator:
    """Free list of KV slots 1..size (slot 0 is the dummy slot), kept on the host.

    free() only queues the slots (O(freed)); they join the free list when alloc() runs out
    of it. Copying the whole free list on every free cost 100 ms per call on a 170M-slot
    pool (a small model on an H200), and speculative decoding frees slots every cycle.
    Queued slots are the allocator's own copies: a caller's tensor may be a view of the
    request->token table, which is rewritten later."""

    def __init__(self, size: int):
        self.size = size
        self.clear()

    def clear(self) -> None:
        self.free_slots = torch.arange(DUMMY_KV_SLOT + 1, self.size + 1, dtype=torch.int64, device="cpu")
        self.released: list[torch.Tensor] = []
        self.num_released = 0

    def available_size(self) -> int:
        return self.free_slots.shape[0] + self.num_released  # shape[0]: cheaper than len(), Python code for a tensor

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, on the host (None if there are fewer)."""
        if n > self.free_slots.shape[0]:
            self._merge_released()
            if n > self.free_slots.shape[0]:
                return None
        out, self.free_slots = self.free_slots[:n], self.free_slots[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Queue slots (host, or device: then read back here, so free device slots only when
        the device is idle anyway, e.g. after the step's sampled ids were read)."""
        if slots.numel():
            self.released.append(slots.to("cpu", torch.int64, copy=True))
            self.num_released += slots.numel()

    def _merge_released(self) -> None:
        if self.released:
            self.free_slots = torch.cat([self.free_slots, *self.released])
            self.released, self.num_released = [], 0


class KVPool(ABC):
    """Per-layer KV storage indexed by slot."""

    size: int
    dtype: torch.dtype
    device: str

    @abstractmethod
    def bytes_per_token(self) -> int: ...


class MHATokenToKVPool(KVPool):
    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str,
        v_head_dim: int | None = None,
    ):
        self.size, self.dtype, self.device = size, dtype, device
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = v_head_dim or head_dim
        self.k_buffer = [torch.zeros((size + 1, head_num, head_dim), dtype=dtype, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((size + 1, head_num, self.v_head_dim), dtype=dtype, device=device) for _ in range(layer_num)]

    def bytes_per_token(self) -> int:
        per_layer = self.head_num * (self.head_dim + self.v_head_dim) * self.dtype.itemsize
        return per_layer * len(self.k_buffer)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k_buffer[layer_id][loc] = k, v_buffer[layer_id][loc] = v (k [T, H, D], v [T, H, Dv], any strides)."""
        k_buf, v_buf = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if k_buf.is_cuda:
            from sglang.srt.kernels.step_ops import store_kv  # triton ships with CUDA builds of torch

            store_kv(k_buf, v_buf, loc, k, v)  # one launch instead of two index_puts
        else:
            k_buf[loc] = k.to(self.dtype)
            v_buf[loc] = v.to(self.dtype)


class MLATokenToKVPool(KVPool):
    """One latent vector (kv_lora_rank + qk_rope_head_dim) per token per layer."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        kv_lora_rank: int,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
    ):
        self.size, self.dtype, self.device = size, dtype, device
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_buffer = [
            torch.zeros((size + 1, 1, kv_lora_rank + qk_rope_head_dim), dtype=dtype, device=device) for _ in range(layer_num)
        ]

    def bytes_per_token(self) -> int:
        return (self.kv_lora_rank + self.qk_rope_head_dim) * self.dtype.itemsize * len(self.kv_buffer)

    def get_kv_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, latent: torch.Tensor) -> None:
        self.kv_buffer[layer_id][loc] = latent.to(self.dtype).view(-1, 1, self.kv_buffer[layer_id].shape[-1])
