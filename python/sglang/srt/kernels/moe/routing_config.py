"""What expert routing computes: the method, scoring and group parameters shared by the
plain-PyTorch `select_experts` and its kernel (routing.select_experts_triton)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


@dataclass(frozen=True)
class RoutingConfig:
    top_k: int
    num_experts: int
    scoring_func: str = "softmax"  # "softmax" | "sigmoid"
    topk_method: str = "greedy"  # one of TOPK_METHODS
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    # Slots top_k .. top_k + num_shared_experts - 1 of every row: expert num_experts + j, weight 1.
    num_shared_experts: int = 0

    @property
    def slots(self) -> int:
        """Experts each token is computed with: its top_k routed ones, then the shared ones."""
        return self.top_k + self.num_shared_experts

    def __post_init__(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            raise ValueError(f"unsupported topk_method {self.topk_method!r}; expected one of {TOPK_METHODS}")
        if self.scoring_func not in ("softmax", "sigmoid"):
            raise ValueError(f"unsupported scoring_func {self.scoring_func!r}")
        if self.topk_method != "greedy" and (
            not self.num_expert_group or not self.topk_group or self.num_experts % self.num_expert_group
        ):
            raise ValueError(f"{self.topk_method} needs n_group dividing the experts and topk_group")
