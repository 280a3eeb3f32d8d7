"""Linear layers sharded over the tensor-parallel group.

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)` that takes
the full (unsharded) checkpoint tensor and copies this rank's slice into place.
Weights are stored [out_features, in_features] like nn.Linear. Sharded layers take the
group they shard over (default: the TP group; attention layers pass the attention-TP group).
Every product goes through `linear`: cuBLAS, or on CUDA at decode batch sizes the Triton
GEMV where its measured table says it is faster (kernels/gemv.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed.parallel_state import ParallelGroup, get_tp
from sglang.srt.layers.activation import SiluAndMul

if TYPE_CHECKING:
    from sglang.srt.kernels.gemv import GemvConfig


def _gemv_config(x: torch.Tensor, weight: torch.Tensor, gated: bool) -> Optional[GemvConfig]:
    """The Triton GEMV's config for x @ weight^T, or None for cuBLAS (always on CPU)."""
    if not x.is_cuda:
        return None
    from sglang.srt.kernels.gemv import pick_config  # triton ships with CUDA builds of torch

    return pick_config(x.numel() // x.shape[-1], weight, gated)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias).to(out_dtype), by cuBLAS or the Triton GEMV (see _gemv_config)."""
    config = _gemv_config(x, weight, gated=False)
    if config is not None:
        from sglang.srt.kernels.gemv import gemv

        return gemv(x, weight, bias, config, out_dtype=out_dtype)
    y = F.linear(x, weight, bias)
    return y if out_dtype is None else y.to(out_dtype)


def _divide(n: int, d: int) -> int:
    if n % d:
        raise ValueError(f"{n} is not divisible by tensor-parallel size {d}")
    return n // d


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch loading weight: parameter {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    dst.copy_(src)


class LinearBase(nn.Module):
    """y = x W^T + b with a local weight of shape [out_local, in_local]."""

    def __init__(self, in_local: int, out_local: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    """Same full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        _copy(param.data, loaded_weight)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        gather_output: bool = False,
        group: Optional[ParallelGroup] = None,
    ):
        self.group = group or get_tp()
        self.tp_size, self.tp_rank = self.group.size, self.group.rank
        self.output_size_per_partition = _divide(output_size, self.tp_size)
        self.gather_output = gather_output
        super().__init__(input_size, self.output_size_per_partition, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        _copy(param.data, loaded_weight.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return self.group.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (e.g. gate_up_proj).

    Each rank holds its slice of every sub-matrix, concatenated in order; shard_id is the
    sub-matrix index.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        gather_output: bool = False,
        group: Optional[ParallelGroup] = None,
    ):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, gather_output, group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[int] = None) -> None:
        if shard_id is None:  # a checkpoint that already stores the merged weight
            sizes = self.output_sizes
            for i, part in enumerate(loaded_weight.split(sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        size = _divide(self.output_sizes[shard_id], self.tp_size)
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy(param.data.narrow(0, offset, size), loaded_weight.narrow(0, self.tp_rank * size, size))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SiluAndMul()(self(x)) for a [gate | up] layer; where the Triton GEMV runs, the
        activation is applied to its output tiles (no gate_up tensor, no extra launch)."""
        assert len(self.output_sizes) == 2 and self.output_sizes[0] == self.output_sizes[1] and not self.gather_output
        config = _gemv_config(x, self.weight, gated=True)
        if config is None:
            return SiluAndMul()(self(x))
        from sglang.srt.kernels.gemv import gemv

        return gemv(x, self.weight, self.bias, config, gated=True)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; heads split across ranks.

    With more ranks than KV heads, each KV head is replicated on tp_size / num_kv_heads ranks.
    Local layout: [q heads | k heads | v heads].
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool = False,
        group: Optional[ParallelGroup] = None,
    ):
        tp_size = (group or get_tp()).size
        self.head_size = head_size
        self.num_heads = _divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = _divide(total_num_kv_heads, tp_size)
            self.kv_replicas = 1
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        total_out = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, total_out, bias, group=group)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Optional[str] = None) -> None:
        if shard_id is None:
            raise ValueError("QKVParallelLinear needs shard_id 'q', 'k' or 'v'")
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        else:
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        _copy(param.data.narrow(0, offset, size), loaded_weight.narrow(0, rank * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed over the group.

    The bias is added once, after the reduction.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        reduce_results: bool = True,
        group: Optional[ParallelGroup] = None,
    ):
        self.group = group or get_tp()
        self.tp_size, self.tp_rank = self.group.size, self.group.rank
        self.input_size_per_partition = _divide(input_size, self.tp_size)
        self.reduce_results = reduce_results
        super().__init__(self.input_size_per_partition, output_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # bias: replicated
            _copy(param.data, loaded_weight)
            return
        n = param.shape[1]
        _copy(param.data, loaded_weight.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        if self.reduce_results:
            y = self.group.all_reduce(y)
        return y + self.bias if self.bias is not None else y


def stack_rows(layers: list[nn.Module]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(weight, bias) stacking the output rows of linear layers that read the same input, so
    that one GEMM computes them all. Each layer's weight (and bias) becomes a view of its rows,
    which its loader fills in place; a layer without a bias contributes zero rows.

    Invariant: the stacked tensors and the layers' parameters share storage. Every loader
    writes in place; re-assigning a parameter (e.g. `module.to`) would break the sharing, and
    the stacked tensors, plain attributes, then stay behind on their device and fail loudly.
    """
    weight = torch.cat([layer.weight.data for layer in layers])
    bias = None
    if any(layer.bias is not None for layer in layers):
        zeros = lambda layer: weight.new_zeros(layer.weight.shape[0])
        bias = torch.cat([zeros(layer) if layer.bias is None else layer.bias.data for layer in layers])
    start = 0
    for layer in layers:
        rows = slice(start, start + layer.weight.shape[0])
        layer.weight.data = weight[rows]
        if layer.bias is not None:
            layer.bias.data = bias[rows]
        start = rows.stop
    return weight, bias
