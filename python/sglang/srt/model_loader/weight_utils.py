"""Checkpoint discovery, lazy tensor iterators, and dummy weights."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator

import torch
from safetensors import safe_open
from torch import nn

from sglang.srt.utils.progress import progress


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
