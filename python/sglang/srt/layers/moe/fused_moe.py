"""Mixture-of-experts over stacked expert weights, shared experts included.

Weights: w13 [slots, 2 * I_local, H] (gate rows then up rows) and w2 [slots, H, I_local],
where I_local is this rank's slice of the intermediate dimension (the experts are split
across the TP group). Slots [0, E) hold the routed experts and [E, E + S) the shared MLP
(intermediate S * I), split into S experts of intermediate I: a SiLU-gated MLP is a sum over
its intermediate channels, so its parts sum to the whole, and routing gives every token all
S of them with weight 1 (RoutingConfig.num_shared_experts). One expert launch thus computes
routed and shared experts; the output is this rank's partial sum, all-reduced by the caller.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_rank, get_tp_size
from sglang.srt.kernels.moe.routing_config import RoutingConfig
from sglang.srt.layers.moe.topk import select_experts


def moe_forward_native(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """SiLU-gated experts; rows are sorted by expert and each expert runs one matmul.

    hidden: [T, H]; topk_weights/topk_ids: [T, slots]. Returns [T, H] in hidden's dtype: the
    weighted expert outputs summed in float32, rounded once. Works for T == 0.
    The per-expert row counts are read on the host (one sync).
    """
    num_tokens, slots = topk_ids.shape
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    rows = order // slots  # token row of each (token, slot) pair, grouped by expert
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    chunks = hidden[rows].split(counts)
    expert_out = []
    for expert, x in enumerate(chunks):
        if x.shape[0] == 0:
            continue
        gate, up = F.linear(x, w13[expert]).chunk(2, dim=-1)
        expert_out.append(F.linear(F.silu(gate) * up, w2[expert]))
    y = torch.cat(expert_out).float() * topk_weights.flatten()[order].float()[:, None]
    out.index_add_(0, rows, y)
    return out.to(hidden.dtype)


class FusedMoE(nn.Module):
    """Routed and shared experts of one layer, sharded along the intermediate dimension
    across TP ranks (each rank holds its slice of every expert, shared ones included)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        routing: RoutingConfig,
        params_dtype: torch.dtype | None = None,
    ):
        super().__init__()
        self.tp_size, self.tp_rank = get_tp_size(), get_tp_rank()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by tp size {self.tp_size}")
        self.num_experts = num_experts
        self.local_intermediate = intermediate_size // self.tp_size
        self.routing = routing
        dtype = params_dtype or torch.get_default_dtype()
        slots = num_experts + routing.num_shared_experts
        self.w13_weight = nn.Parameter(
            torch.empty(slots, 2 * self.local_intermediate, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(torch.empty(slots, hidden_size, self.local_intermediate, dtype=dtype), requires_grad=False)

    def weight_loader(self, shard: str, expert_id: Optional[int], loaded: torch.Tensor) -> None:
        """Copy a full HF weight (gate_proj / up_proj / down_proj) into this rank's slice: of
        routed expert `expert_id`, or with expert_id None of the shared MLP (intermediate
        S * I), whose rank slice of S * I_local channels fills the S shared slots in order."""
        n = self.local_intermediate
        if expert_id is not None:
            self._load_slot(expert_id, shard, loaded, self.tp_rank * n)
            return
        num_shared = self.routing.num_shared_experts
        for j in range(num_shared):
            self._load_slot(self.num_experts + j, shard, loaded, (self.tp_rank * num_shared + j) * n)

    def _load_slot(self, slot: int, shard: str, loaded: torch.Tensor, lo: int) -> None:
        """Intermediate channels [lo, lo + I_local) of `loaded` into expert slot `slot`."""
        n = self.local_intermediate
        if shard == "down_proj":
            self.w2_weight.data[slot].copy_(loaded[:, lo : lo + n])
        elif shard in ("gate_proj", "up_proj"):
            dst = 0 if shard == "gate_proj" else n
            self.w13_weight.data[slot, dst : dst + n].copy_(loaded[lo : lo + n])
        else:
            raise ValueError(f"unknown expert shard {shard!r}")

    def warm_up_kernels(self, max_tokens: int) -> int:
        """CUDA: compile the expert kernels' variants for batches of up to max_tokens tokens now
        (grouped_gemm.warm_up_variants); returns the batches run (0 off CUDA)."""
        if not self.w13_weight.is_cuda:
            return 0
        from sglang.srt.kernels.moe.grouped_gemm import warm_up_variants

        return warm_up_variants(self.w13_weight, self.w2_weight, self.routing.slots, max_tokens)

    def forward(
        self, hidden: torch.Tensor, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """This rank's partial sum [T, H] of the routed and shared experts; the caller all-reduces."""
        if not hidden.is_cuda:
            topk_weights, topk_ids = select_experts(router_logits, self.routing, correction_bias)
            return moe_forward_native(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        # triton ships with CUDA builds of torch; its kernels never sync with the host
        from sglang.srt.kernels.moe.grouped_gemm import fused_moe
        from sglang.srt.kernels.moe.routing import select_experts_triton

        topk_weights, topk_ids = select_experts_triton(router_logits, self.routing, correction_bias)
        return fused_moe(
            hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, shared_slots=self.routing.num_shared_experts
        )
