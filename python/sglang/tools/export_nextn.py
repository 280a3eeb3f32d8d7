"""Extract the MTP (NextN) layer of a DeepSeek-V3 checkpoint into a standalone draft checkpoint.

    python -m sglang.tools.export_nextn --input TARGET_DIR --output DRAFT_DIR

Output format (read by DeepseekV3ForCausalLMNextN, usable as --speculative-draft-model-path):
- config.json: the target's config with architectures ["DeepseekV3ForCausalLMNextN"] and
  num_hidden_layers = 1 (the draft has one decoder layer, and its KV pool one layer);
- model.safetensors: every tensor of `model.layers.{N}.*` (N = the target's
  num_hidden_layers) renamed to `model.layers.1.*`, so that in both formats the MTP layer
  sits at index num_hidden_layers;
- tokenizer / generation files copied unchanged.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil

from safetensors import safe_open
from safetensors.torch import save_file

from sglang.srt.model_loader.weight_utils import find_weight_files

DRAFT_ARCHITECTURE = "DeepseekV3ForCausalLMNextN"
DRAFT_NUM_LAYERS = 1
_COPIED_PATTERNS = (
    "tokenizer*",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template*",
    "vocab.*",
    "merges.txt",
    "*.tiktoken",
)


def export_nextn(input_dir: str, output_dir: str) -> str:
    with open(os.path.join(input_dir, "config.json")) as f:
        config = json.load(f)
    src_prefix = f"model.layers.{config['num_hidden_layers']}."
    dst_prefix = f"model.layers.{DRAFT_NUM_LAYERS}."
    tensors = {}
    for path in find_weight_files(input_dir, "safetensors"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                if name.startswith(src_prefix):
                    tensors[dst_prefix + name[len(src_prefix) :]] = f.get_tensor(name)
    if not tensors:
        raise ValueError(f"{input_dir} has no MTP layer: no tensor named {src_prefix}*")
    os.makedirs(output_dir, exist_ok=True)
    save_file(tensors, os.path.join(output_dir, "model.safetensors"), metadata={"format": "pt"})
    config.update(architectures=[DRAFT_ARCHITECTURE], num_hidden_layers=DRAFT_NUM_LAYERS)
    with open(os.path.join(output_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for pattern in _COPIED_PATTERNS:
        for path in glob.glob(os.path.join(input_dir, pattern)):
            shutil.copy2(path, output_dir)
    return output_dir


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="DeepSeek-V3 checkpoint directory holding the MTP layer.")
    parser.add_argument("--output", required=True, help="Directory to write the standalone NextN checkpoint to.")
    args = parser.parse_args(argv)
    out = export_nextn(args.input, args.output)
    print(f"NextN checkpoint written to {out}")


if __name__ == "__main__":
    main()
