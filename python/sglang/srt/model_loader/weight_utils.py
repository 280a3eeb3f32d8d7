"""Checkpoint discovery, lazy tensor iterators, and the generic parameter-loading helpers."""

from __future__ import annotations

import glob
import json
import os
from typing import Collection, Iterable, Iterator, Sequence

import torch
from safetensors import safe_open
from torch import nn

from sglang.srt.utils.progress import progress

# (model param fragment, checkpoint fragment, shard id): checkpoint tensors fused into one parameter.
StackedMapping = Sequence[tuple[str, str, object]]


def find_weight_files(model_dir: str, load_format: str) -> list[str]:
    """Checkpoint files of a directory; an index json (sharded checkpoint) wins over a glob."""
    suffix, index_name = {
        "safetensors": (".safetensors", "model.safetensors.index.json"),
        "pt": (".bin", "pytorch_model.bin.index.json"),
    }[load_format]
    index = os.path.join(model_dir, index_name)
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
    else:
        files = sorted(glob.glob(os.path.join(model_dir, f"*{suffix}")))
    if not files:
        raise FileNotFoundError(f"no *{suffix} weight files in {model_dir}")
    return files


def safetensors_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, with a progress bar over all tensors."""
    total = 0
    for path in files:
        with safe_open(path, framework="pt") as f:
            total += len(f.keys())
    yield from progress(_safetensors_tensors(files), "Loading safetensors weights", "tensor", total)


def _safetensors_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def pt_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for path in progress(files, "Loading pt weights", "file"):
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()
        del state


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


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = 42, low: float = -1e-3, high: float = 1e-3) -> None:
    """Fill every parameter with U(low, high), deterministic from seed (per device type).

    The small range keeps activations and logits finite for any architecture.
    """
    for _, param in sorted(model.named_parameters()):
        gen = torch.Generator(device=param.device).manual_seed(seed)
        if param.is_floating_point():
            param.uniform_(low, high, generator=gen)
        seed += 1
