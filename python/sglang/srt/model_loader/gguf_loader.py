"""GGUF weights, dequantized by the `gguf` package, yielded one tensor at a time under HF names.

GGUF -> HF names come from gguf's own tensor-name map applied to the parameter names of
the transformers model for this config (built on the meta device: no memory). The
per-architecture fix-ups (e.g. undoing llama.cpp's Q/K row permutation) are
transformers' GGUF tensor processors. This is transformers' `load_gguf_checkpoint`
logic without its per-submodule name-map rebuilds (minutes on big models) and without
holding every dequantized tensor at once.
"""

from __future__ import annotations

from collections.abc import Iterator

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

from sglang.srt.utils.progress import progress


def _gguf_to_hf_names(arch: str, hf_config: PretrainedConfig) -> dict[str, str]:
    arch_enum = next((k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), None)
    if arch_enum is None:
        raise NotImplementedError(f"GGUF architecture {arch!r} is unknown to the gguf package")
    name_map = gguf.get_tensor_name_map(arch_enum, hf_config.num_hidden_layers)
    with torch.device("meta"):
        hf_names = list(AutoModelForCausalLM.from_config(hf_config).state_dict())
    mapping = {}
    for hf_name in hf_names:
        base, _, suffix = hf_name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, suffix = hf_name, ""
        gguf_name = name_map.get_name(base)
        if gguf_name is not None:
            mapping[gguf_name + (f".{suffix}" if suffix else "")] = hf_name
    return mapping


def gguf_weights_iterator(path: str, hf_config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    reader = gguf.GGUFReader(path)
    arch = read_field(reader, "general.architecture")[0]
    mapping = _gguf_to_hf_names(arch, hf_config)
    config = hf_config.to_dict()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    for tensor in progress(reader.tensors, "Loading GGUF weights", "tensor"):
        weights = gguf.dequantize(tensor.data, tensor.tensor_type)
        result = processor.process(
            weights=weights,
            name=tensor.name,
            tensor_key_mapping=mapping,
            parsed_parameters={"config": config, "tensors": {}},
        )
        if result.name in mapping:
            yield mapping[result.name], torch.from_numpy(np.array(result.weights))  # a writable copy, not a file view
