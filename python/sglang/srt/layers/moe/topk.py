"""Expert routing for DeepSeek-style MoE layers.

DeepSeek-V2: softmax scores; top-k over all experts ("greedy") or over the best
`topk_group` groups ranked by their best expert ("group_limited_greedy").
DeepSeek-V3: sigmoid scores; groups ranked by the sum of their two best bias-corrected
scores, experts chosen by bias-corrected score, weighted by the uncorrected score
("noaux_tc"). Weights are optionally renormalized, then multiplied by routed_scaling_factor.
Shared experts (always selected, weight 1, never scaled) follow the top_k routed slots, so
one expert launch computes routed and shared experts alike.
Everything is computed in float32 and accepts 0 rows.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.kernels.moe.routing_config import RoutingConfig


def _mask_to_top_groups(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int, fill: float) -> torch.Tensor:
    """Keep the experts of the `topk_group` best groups; set every other expert to `fill`."""
    num_tokens, num_groups = group_scores.shape
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask[:, :, None].expand(num_tokens, num_groups, scores.shape[-1] // num_groups)
    return scores.masked_fill(~expert_mask.reshape(scores.shape), fill)


def select_experts(
    router_logits: torch.Tensor, cfg: RoutingConfig, correction_bias: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E]. Returns (weights [T, slots] float32, expert ids [T, slots] int64):
    the top_k routed experts, then the shared ones."""
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
    num_tokens = scores.shape[0]
    group_size = cfg.num_experts // (cfg.num_expert_group or 1)  # explicit: -1 is ambiguous for 0 rows
    if cfg.topk_method == "noaux_tc":
        choice = scores + correction_bias.float() if correction_bias is not None else scores
        grouped = choice.view(num_tokens, cfg.num_expert_group, group_size)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        choice = _mask_to_top_groups(choice, group_scores, cfg.topk_group, float("-inf"))
        topk_ids = torch.topk(choice, k=cfg.top_k, dim=-1, sorted=False)[1]
        topk_weights = scores.gather(1, topk_ids)
    else:
        if cfg.topk_method == "group_limited_greedy":
            group_scores = scores.view(num_tokens, cfg.num_expert_group, group_size).amax(dim=-1)
            scores = _mask_to_top_groups(scores, group_scores, cfg.topk_group, 0.0)
        topk_weights, topk_ids = torch.topk(scores, k=cfg.top_k, dim=-1, sorted=False)
    if cfg.renormalize:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    topk_weights = topk_weights * cfg.routed_scaling_factor
    if not cfg.num_shared_experts:
        return topk_weights, topk_ids
    shared_ids = torch.arange(cfg.num_experts, cfg.num_experts + cfg.num_shared_experts, device=topk_ids.device)
    shared_ids = shared_ids.expand(num_tokens, -1)
    shared_weights = torch.ones(shared_ids.shape, dtype=torch.float32, device=topk_ids.device)
    return torch.cat([topk_weights, shared_weights], 1), torch.cat([topk_ids, shared_ids], 1)
