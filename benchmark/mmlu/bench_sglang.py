"""MMLU against a running server, with SGLang's interface.

    python benchmark/mmlu/bench_sglang.py --data_dir data --nsub 57 --parallel 64 --port 30000

--data_dir has Hendrycks' layout: dev/{subject}_dev.csv (few-shot examples) and
test/{subject}_test.csv, no header, columns question, A, B, C, D, answer letter. Each
question gets the subject's first --ntrain dev examples (fewer when the prompt would exceed
--max_prompt_tokens with the server's tokenizer) and one greedy new token through
/generate; the answer is that token's first non-space character. Prints per-subject and
average accuracy, latency, and the server's accept length when speculation is on.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import requests

from sglang.bench_serving import report_accept_lengths, server_accept_lengths

CHOICES = "ABCD"


def read_rows(path: str) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return [row for row in csv.reader(f) if row]


def subjects_of(data_dir: str) -> list[str]:
    return sorted(name[: -len("_test.csv")] for name in os.listdir(os.path.join(data_dir, "test")) if name.endswith("_test.csv"))


def format_example(row: list[str], with_answer: bool) -> str:
    text = row[0] + "".join(f"\n{letter}. {option}" for letter, option in zip(CHOICES, row[1:5])) + "\nAnswer:"
    return text + f" {row[5]}\n\n" if with_answer else text


def build_prompt(subject: str, shots: list[list[str]], question: list[str], count_tokens, max_tokens: int) -> str:
    """Instruction + as many of the shots (in order) as fit in max_tokens + the question."""
    head = f"The following are multiple choice questions (with answers) about {subject.replace('_', ' ')}.\n\n"
    k = len(shots)
    while True:
        prompt = head + "".join(format_example(s, True) for s in shots[:k]) + format_example(question, False)
        if k == 0 or count_tokens(prompt) <= max_tokens:
            return prompt
        k -= 1


def generate(base_url: str, prompt: str) -> str:
    body = {"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    resp = requests.post(f"{base_url}/generate", json=body, timeout=600)
    resp.raise_for_status()
    return resp.json()["text"]


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data_dir", default="data")
    p.add_argument("--nsub", type=int, default=60, help="first N subjects (alphabetical)")
    p.add_argument("--ntrain", type=int, default=5, help="few-shot examples per question")
    p.add_argument("--max_prompt_tokens", type=int, default=1536)
    p.add_argument("--parallel", type=int, default=64)
    p.add_argument("--host", default="http://127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", default="srt")
    p.add_argument("--result-file", "--result_file", dest="result_file", default="result.jsonl")
    args = p.parse_args(argv)

    host = args.host if "://" in args.host else f"http://{args.host}"
    base_url = f"{host}:{args.port}"
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    tokenizer = get_tokenizer(requests.get(f"{base_url}/get_model_info", timeout=30).json()["tokenizer_path"])

    def count_tokens(text: str) -> int:
        return len(tokenizer.encode(text))

    subjects = subjects_of(args.data_dir)[: args.nsub]
    prompts, labels, owner = [], [], []
    for subject in subjects:
        shots = read_rows(os.path.join(args.data_dir, "dev", f"{subject}_dev.csv"))[: args.ntrain]
        for row in read_rows(os.path.join(args.data_dir, "test", f"{subject}_test.csv")):
            prompts.append(build_prompt(subject, shots, row, count_tokens, args.max_prompt_tokens))
            labels.append(row[5].strip())
            owner.append(subject)

    start = time.perf_counter()
    with ThreadPoolExecutor(max(1, args.parallel)) as pool:
        outputs = list(pool.map(lambda prompt: generate(base_url, prompt), prompts))
    latency = time.perf_counter() - start

    correct = [out.strip()[:1].upper() == label for out, label in zip(outputs, labels)]
    for subject in subjects:
        mine = [c for c, s in zip(correct, owner) if s == subject]
        print(f"Average accuracy {sum(mine) / len(mine):.3f} - {subject}")
    accuracy = sum(correct) / len(correct)
    per_rank = server_accept_lengths(base_url)
    print(f"Total latency: {latency:.3f} s")
    print(f"Average accuracy: {accuracy:.3f}")
    accept = report_accept_lengths(per_rank)
    if accept is not None:
        print(f"Accept length: {accept:.3f}")
    result = {
        "task": "mmlu",
        "backend": args.backend,
        "latency": round(latency, 3),
        "accuracy": round(accuracy, 3),
        "num_requests": len(prompts),
        "accept_length": accept,
        "accept_length_per_rank": per_rank,
        "other": {"nsub": len(subjects), "ntrain": args.ntrain, "parallel": args.parallel},
    }
    if args.result_file:
        with open(args.result_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
