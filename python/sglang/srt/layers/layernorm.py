"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Without residual: norm(x). With residual: s = x + residual; returns (norm(s), s)."""
        return (self.forward_triton if x.is_cuda else self.forward_native)(x, residual)

    def forward_triton(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        from sglang.srt.kernels import elementwise  # triton ships with CUDA builds of torch

        if residual is None:
            return elementwise.rms_norm(x, self.weight, self.variance_epsilon)
        return elementwise.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def forward_native(
        self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
    ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if residual is not None:
            x = x + residual
            residual = x
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * h.to(dtype)
        return out if residual is None else (out, residual)


def rms_norm_pair(norm_a: RMSNorm, a: torch.Tensor, norm_b: RMSNorm, b: torch.Tensor) -> torch.Tensor:
    """norm_a(a) ‖ norm_b(b) along the last dim: one kernel on CUDA instead of two norms and a cat."""
    if a.is_cuda:
        from sglang.srt.kernels import elementwise  # triton ships with CUDA builds of torch

        eps_a, eps_b = norm_a.variance_epsilon, norm_b.variance_epsilon
        return elementwise.rms_norm_pair(a, norm_a.weight, eps_a, b, norm_b.weight, eps_b)
    return torch.cat([norm_a.forward_native(a), norm_b.forward_native(b)], dim=-1)
