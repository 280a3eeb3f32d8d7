"""The pre-norm decoder layer step shared by the Llama and DeepSeek families."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from sglang.srt.batch.forward_batch_info import ForwardBatch
from sglang.srt.layers.dp_attention import DpRanks, mlp_over_dp


class PreNormDecoderLayer(nn.Module):
    """Subclasses set self_attn, mlp, input_layernorm and post_attention_layernorm. The DP ranks
    that the MLP gathers over (DP attention) are read once, when the layer is built."""

    def __init__(self) -> None:
        super().__init__()
        self.dp_ranks = DpRanks.current()

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        forward_batch: ForwardBatch,
        residual: Optional[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream before it); the caller adds them."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        return self.mlp_after_attention(hidden_states, residual, forward_batch)

    def mlp_after_attention(
        self, attn_out: torch.Tensor, residual: torch.Tensor, forward_batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp(post_attention_layernorm(attn_out + residual)), attn_out + residual)."""
        hidden_states, residual = self.post_attention_layernorm(attn_out, residual)
        return mlp_over_dp(self.mlp, hidden_states, forward_batch, self.dp_ranks), residual
