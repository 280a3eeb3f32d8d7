"""GGUF weights: dequantized by the `gguf` package through transformers, with HF tensor names.

transformers maps GGUF names to its own model's parameter names (and undoes llama.cpp's
Q/K permutation); it needs an instance of that model to read the names from, so we
build one on the meta device (no memory).
"""

from __future__ import annotations

from typing import Iterator

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint


def gguf_weights_iterator(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        name_source = AutoModelForCausalLM.from_config(hf_config)
    parsed = load_gguf_checkpoint(path, return_tensors=True, model_to_load=name_source)
    tensors: dict[str, torch.Tensor] = parsed["tensors"]
    while tensors:  # hand each tensor over and drop our reference
        name = next(iter(tensors))
        yield name, tensors.pop(name)
