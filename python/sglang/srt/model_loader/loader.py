"""Build a model from a ModelConfig and fill its weights."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
from torch import nn

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.model_loader.weight_utils import (
    find_weight_files,
    init_dummy_weights,
    pt_weights_iterator,
    safetensors_weights_iterator,
)
from sglang.srt.models.registry import get_model_class
from sglang.srt.utils.hf_transformers_utils import is_gguf

logger = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "gguf")


@contextlib.contextmanager
def _build_context(dtype: torch.dtype, device: str):
    """Create tensors directly on `device` with `dtype`; restores the previous defaults."""
    old_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)


def resolve_load_format(model_path: str, load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; choose one of {LOAD_FORMATS}")
    if load_format != "auto":
        return load_format
    if is_gguf(model_path):
        return "gguf"
    has_safetensors = any(f.endswith(".safetensors") for f in os.listdir(model_path))
    return "safetensors" if has_safetensors else "pt"


def iterate_weights(model_config: ModelConfig, load_format: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the checkpoint; load_format already resolved (not auto/dummy)."""
    if load_format == "gguf":
        from sglang.srt.model_loader.gguf_loader import gguf_weights_iterator  # needs the gguf package

        return gguf_weights_iterator(model_config.model_path, model_config.hf_config)
    files = find_weight_files(model_config.model_path, load_format)
    if load_format == "safetensors":
        return safetensors_weights_iterator(files)
    return pt_weights_iterator(files)


def get_model(model_config: ModelConfig, load_format: str, device: str, seed: int = 42) -> nn.Module:
    """The model of model_config's architecture, in eval mode, on device, in model_config.dtype."""
    load_format = resolve_load_format(model_config.model_path, load_format)
    model_cls = get_model_class(model_config.architectures)
    logger.info("Building %s (%s, %s) with %s weights", model_cls.__name__, model_config.dtype, device, load_format)
    with _build_context(model_config.dtype, device):
        model = model_cls(model_config.hf_config)
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        model.load_weights(iterate_weights(model_config, load_format))
    return model.eval()
