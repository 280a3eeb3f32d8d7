"""Mixture-of-experts over stacked expert weights.

Weights: w13 [E, 2 * I_local, H] (gate rows then up rows) and w2 [E, H, I_local], where
I_local is this rank's slice of the intermediate dimension (the experts are split across
the TP group). The output is this rank's partial sum: the caller all-reduces it once per
layer, together with the shared experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import get_tp_rank, get_tp_size
from sglang.srt.layers.moe.topk import RoutingConfig, select_experts


def moe_forward_native(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    shared_output: torch.Tensor | None = None,
) -> torch.Tensor:
    """SiLU-gated experts; rows are sorted by expert and each expert runs one matmul.

    hidden: [T, H]; topk_weights/topk_ids: [T, k]. Returns [T, H] in hidden's dtype, plus
    shared_output [T, H] when given (added after the rounding to hidden's dtype).
    Works for T == 0. The per-expert row counts are read on the host (one sync).
    """
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    if num_tokens == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    rows = order // top_k  # token row of each (token, slot) pair, grouped by expert
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
    out = out.to(hidden.dtype)
    return out if shared_output is None else out + shared_output


class FusedMoE(nn.Module):
    """Routed experts of one layer, sharded along the intermediate dimension across TP ranks."""

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
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_intermediate, hidden_size, dtype=dtype), requires_grad=False
        )
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_intermediate, dtype=dtype), requires_grad=False
        )

    def weight_loader(self, shard: str, expert_id: int, loaded: torch.Tensor) -> None:
        """Copy one expert's full HF weight (gate_proj / up_proj / down_proj) into this rank's slice."""
        n = self.local_intermediate
        lo = self.tp_rank * n
        if shard == "down_proj":
            self.w2_weight.data[expert_id].copy_(loaded[:, lo : lo + n])
        elif shard in ("gate_proj", "up_proj"):
            dst = 0 if shard == "gate_proj" else n
            self.w13_weight.data[expert_id, dst : dst + n].copy_(loaded[lo : lo + n])
        else:
            raise ValueError(f"unknown expert shard {shard!r}")

    def forward(
        self,
        hidden: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Partial (this rank's) routed-expert output [T, H], plus shared_output [T, H] when
        given (the shared experts' partial sum, added in the same launch); the caller all-reduces."""
        route, experts = select_experts, moe_forward_native
        if hidden.is_cuda:  # triton ships with CUDA builds of torch; its kernels never sync with the host
            from sglang.srt.layers.moe.fused_moe_triton import fused_moe as experts
            from sglang.srt.layers.moe.topk_triton import select_experts_triton as route
        topk_weights, topk_ids = route(router_logits, self.routing, correction_bias)
        return experts(hidden, self.w13_weight, self.w2_weight, topk_weights, topk_ids, shared_output)
