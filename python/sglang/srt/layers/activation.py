"""Activation functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x of last dim 2d (the gate_up_proj output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.forward_triton if x.is_cuda else self.forward_native)(x)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        from sglang.srt.kernels.elementwise import silu_and_mul  # triton ships with CUDA builds of torch

        return silu_and_mul(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
