"""Greedy agreement between two runs of a model (e.g. GPU bf16 against CPU float32).

    python benchmark/accuracy/greedy_agreement.py --model-path SmolLM2-135M-Instruct --out cpu.json -- --device cpu
    python benchmark/accuracy/greedy_agreement.py --model-path SmolLM2-135M-Instruct --out gpu.json --compare cpu.json

Prints, per prompt, how many of the first --max-new-tokens greedy tokens match the reference.
"""

from __future__ import annotations

import argparse
import json
import sys

import sglang as sgl
from sglang.srt.server_args import prepare_server_args

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
    "What is 12 times 12?",
    "Translate 'good morning' into Spanish.",
    "Who wrote Romeo and Juliet?",
    "Explain what a CPU does in one sentence.",
    "List the first five prime numbers.",
    "What color is the sky on a clear day?",
    "Give me a synonym for 'happy'.",
    "What is the boiling point of water in Celsius?",
]


def main() -> None:
    argv = sys.argv[1:]
    engine_argv = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args(argv)

    server_args = prepare_server_args(["--model-path", args.model_path, *engine_argv])
    with sgl.Engine(**vars(server_args)) as engine:
        tok = engine.tokenizer_manager.tokenizer
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) for p in PROMPTS
        ]
        params = {"max_new_tokens": args.max_new_tokens, "temperature": 0}
        outs = engine.generate(prompts, params)
    result = [{"prompt": p, "output_ids": o["output_ids"], "text": o["text"]} for p, o in zip(PROMPTS, outs)]
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.compare:
        with open(args.compare) as f:
            ref = json.load(f)
        full = 0
        for r, o in zip(ref, result):
            a, b = r["output_ids"], o["output_ids"]
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            full += same == len(a) == len(b)
            print(f"{same:2d}/{len(a)} matching  {o['prompt']!r} -> {o['text']!r}")
        print(f"identical first {args.max_new_tokens} tokens: {full}/{len(result)} prompts")


if __name__ == "__main__":
    main()
