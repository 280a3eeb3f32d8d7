"""Checkpoint tensors into a model's parameters, through each parameter's weight_loader."""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch
from torch import nn

# (model param fragment, checkpoint fragment, shard id): checkpoint tensors fused into one parameter.
StackedMapping = Sequence[tuple[str, str, object]]


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


def load_weights_into(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked_mapping: StackedMapping = (),
    skip_prefixes: Sequence[str] = (),
    skip_substrings: Sequence[str] = (),
    optional: Collection[str] = (),
) -> set[str]:
    """Copy checkpoint tensors into `model` via each parameter's weight_loader.

    Names matching `stacked_mapping` go to the fused parameter with their shard id.
    Raises on a checkpoint tensor with no parameter, and on a parameter left unloaded
    unless `optional` names it. Returns the loaded parameter names.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.startswith(tuple(skip_prefixes)) or any(s in name for s in skip_substrings):
            continue
        for param_frag, ckpt_frag, shard_id in stacked_mapping:
            if ckpt_frag in name:
                target = name.replace(ckpt_frag, param_frag)
                _param(params, target, name).weight_loader(params[target], tensor, shard_id)
                break
        else:
            target = name
            param = _param(params, target, name)
            getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        loaded.add(target)
    missing = sorted(set(params) - loaded - set(optional))
    if missing:
        raise ValueError(f"checkpoint is missing parameters: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    return loaded


def _param(params: dict[str, nn.Parameter], target: str, ckpt_name: str) -> nn.Parameter:
    if target not in params:
        raise KeyError(f"checkpoint tensor {ckpt_name!r} has no matching model parameter {target!r}")
    return params[target]
