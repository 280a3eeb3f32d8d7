"""Benchmark scripts and the tiny-model training tool, on CPU.

- train_tiny_models for a few steps (tiny shapes, a few stdlib files): the DeepSeek checkpoint
  has the MTP layer in the DeepSeek layout, the engine's NEXTN greedy output equals
  transformers' greedy output of the same checkpoint, and the EAGLE head it trains for a tiny
  Llama serves in a server;
- that server (tiny Llama + trained EAGLE head) answers the MMLU script on a tiny MMLU-format
  set and bench_serving (random and file prompts) with the accept length reported;
- bench_one_batch on the tiny Llama; spec_sweep's table; flag_ab's variants, round order and
  table, and one round of plain against mixed-chunk servers on the tiny Llama.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

import sglang as sgl
from sglang import bench_one_batch, bench_serving
from sglang.test.server_utils import kill_server, popen_launch_server
from sglang.tools import train_tiny_models

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MMLU_ROWS = {
    "astronomy": [["What orbits the Earth?", "The Moon", "Mars", "The Sun", "Venus", "A"]] * 3,
    "high_school_math": [["What is 2 + 2?", "3", "4", "5", "6", "B"], ["What is 3 * 3?", "6", "8", "9", "12", "C"]],
}


def _load_script(relpath: str):
    spec = importlib.util.spec_from_file_location(os.path.basename(relpath)[:-3], os.path.join(REPO, relpath))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tiny_llama_unsharded_dir, tmp_path_factory) -> dict[str, str]:
    llama = tiny_llama_unsharded_dir
    out = str(tmp_path_factory.mktemp("trained") / "out")
    train_tiny_models.main(
        [
            "--out",
            out,
            "--device",
            "cpu",
            "--max-steps",
            "2",
            "--shape",
            "tiny",
            "--vocab-size",
            "320",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--max-files",
            "20",
            "--eagle-target",
            llama,
        ]
    )
    return {
        "llama": llama,
        "deepseek": os.path.join(out, "deepseek-v3-mtp"),
        "eagle": os.path.join(out, train_tiny_models.eagle_dir_name(llama)),
        "prompts": os.path.join(out, "heldout_prompts.jsonl"),
    }


@pytest.fixture(scope="module")
def server(trained):
    proc = popen_launch_server(
        trained["llama"],
        [
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--speculative-algorithm",
            "EAGLE",
            "--speculative-draft-model-path",
            trained["eagle"],
        ],
    )
    yield proc
    kill_server(proc)


# ---------------------------------------------------------------------------- training tool
def test_deepseek_checkpoint_has_mtp_layer_in_deepseek_layout(trained):
    config = json.load(open(os.path.join(trained["deepseek"], "config.json")))
    n = config["num_hidden_layers"]
    with safe_open(os.path.join(trained["deepseek"], "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert torch.equal(f.get_tensor(f"model.layers.{n}.shared_head.head.weight"), f.get_tensor("lm_head.weight"))
    mtp = f"model.layers.{n}."
    for extra in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "embed_tokens.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "mlp.gate.weight",
    ):
        assert mtp + extra in names
    assert not any(name.startswith(f"model.layers.{n + 1}.") for name in names)


def test_trained_deepseek_nextn_matches_transformers_greedy(trained):
    path = trained["deepseek"]
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer.encode("import os\ndef main(")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(prompt) :].tolist()
    with sgl.Engine(model_path=path, device="cpu", dtype="float32", speculative_algorithm="NEXTN") as engine:
        out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        accept = engine.get_server_info()["internal_states"][0]["avg_spec_accept_length"]
    assert out["output_ids"] == expected
    assert out["meta_info"]["spec_verify_ct"] >= 1 and 1.0 <= accept <= 4.0


def test_draft_loss_falls_when_training_a_head(tiny_llama_unsharded_dir):
    """A few steps on one batch must lower the distillation loss (the loss trains the head)."""
    from sglang.tools.draft_heads import EagleHead, draft_loss

    target = AutoModelForCausalLM.from_pretrained(tiny_llama_unsharded_dir, dtype=torch.float32).eval()
    torch.manual_seed(0)
    head = EagleHead(target.config)
    ids = torch.randint(0, target.config.vocab_size, (2, 24))
    with torch.no_grad():
        hidden = target.model(input_ids=ids).last_hidden_state
        logits = target.lm_head(hidden)
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        loss, _ = draft_loss(head, target.model.embed_tokens, target.lm_head, ids, hidden, logits, unroll=2)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert losses[-1] < 0.7 * losses[0]


# ---------------------------------------------------------------------------- MMLU
def _write_mmlu(root) -> str:
    for split in ("dev", "test"):
        os.makedirs(root / split, exist_ok=True)
        for subject, rows in MMLU_ROWS.items():
            with open(root / split / f"{subject}_{split}.csv", "w", newline="") as f:
                csv.writer(f).writerows(rows)
    return str(root)


def test_mmlu_prompt_trims_shots_to_the_token_budget():
    mmlu = _load_script("benchmark/mmlu/bench_sglang.py")
    shots = MMLU_ROWS["high_school_math"]
    full = mmlu.build_prompt("high_school_math", shots, shots[0], len, 10_000)
    assert full.startswith("The following are multiple choice questions (with answers) about high school math.\n\n")
    assert full.count("Answer:") == 3 and full.endswith("What is 2 + 2?\nA. 3\nB. 4\nC. 5\nD. 6\nAnswer:")
    trimmed = mmlu.build_prompt("high_school_math", shots, shots[0], len, len(full) - 1)
    assert trimmed.count("Answer:") == 2


def test_synthetic_mmlu_set_has_hendrycks_layout_and_right_answers(tmp_path):
    synthetic = _load_script("benchmark/mmlu/make_synthetic.py")
    root = synthetic.write(str(tmp_path / "syn"), num_dev=2, num_test=4, seed=0)
    mmlu = _load_script("benchmark/mmlu/bench_sglang.py")
    assert mmlu.subjects_of(root) == ["addition", "multiplication", "subtraction"]
    for subject in mmlu.subjects_of(root):
        rows = mmlu.read_rows(os.path.join(root, "test", f"{subject}_test.csv"))
        assert len(rows) == 4 and len(mmlu.read_rows(os.path.join(root, "dev", f"{subject}_dev.csv"))) == 2
        for row in rows:
            expression = row[0].removeprefix("What is ").removesuffix("?")
            assert int(row[1 + "ABCD".index(row[5])]) == eval(expression) and len(set(row[1:5])) == 4


def test_mmlu_script_scores_the_servers_answers(server, trained, tmp_path):
    mmlu = _load_script("benchmark/mmlu/bench_sglang.py")
    data = _write_mmlu(tmp_path / "mmlu")
    port = server.base_url.rsplit(":", 1)[1]
    result_file = str(tmp_path / "result.jsonl")
    result = mmlu.main(
        ["--data_dir", data, "--nsub", "2", "--ntrain", "2", "--parallel", "3", "--port", port, "--result-file", result_file]
    )
    # Score the same prompts independently from the server's raw answers.
    tokenizer = AutoTokenizer.from_pretrained(trained["llama"])
    correct = []
    for subject, rows in MMLU_ROWS.items():
        for row in rows:
            prompt = mmlu.build_prompt(subject, rows[:2], row, lambda t: len(tokenizer.encode(t)), 1536)
            text = mmlu.generate(server.base_url, prompt)
            correct.append(text.strip()[:1].upper() == row[5])
    assert result["num_requests"] == 5
    assert result["accuracy"] == round(sum(correct) / len(correct), 3)
    assert result["accept_length"] is not None  # the server speculates
    assert result["accept_length_per_rank"] == [result["accept_length"]]  # one DP rank
    assert json.loads(open(result_file).read().splitlines()[-1])["accuracy"] == result["accuracy"]


# ---------------------------------------------------------------------------- bench_serving
def test_bench_serving_random_prompts(server, tmp_path):
    out_file = str(tmp_path / "serving.jsonl")
    args = bench_serving.get_parser().parse_args(
        [
            "--base-url",
            server.base_url,
            "--num-prompts",
            "4",
            "--random-input-len",
            "8",
            "--random-output-len",
            "5",
            "--random-range-ratio",
            "1",
            "--max-concurrency",
            "2",
            "--output-file",
            out_file,
        ]
    )
    m = bench_serving.run_benchmark(args)
    assert m["completed"] == 4 and m["total_output_tokens"] == 20 and m["total_input_tokens"] == 32
    assert 0 < m["median_ttft_ms"] <= m["median_e2e_latency_ms"] and m["median_tpot_ms"] > 0 and m["p99_itl_ms"] > 0
    assert 1.0 <= m["accept_length"] <= 4.0 and m["server_accept_length_per_rank"] == [m["server_accept_length"]]
    # the client's own CPU during the requests: some, at most all of the run's wall time and a core
    assert 0 < m["client_cpu_fraction"] <= 1.05 and m["client_cpu_us_per_output_token"] > 0
    assert json.loads(open(out_file).read())["completed"] == 4


@pytest.mark.parametrize("per_rank, warned", [([3.69, 2.12], True), ([3.5, 3.45], False), ([3.5], False)])
def test_bench_serving_prints_each_dp_ranks_accept_length(capsys, per_rank, warned):
    assert bench_serving.report_accept_lengths(per_rank) == pytest.approx(sum(per_rank) / len(per_rank))
    out = capsys.readouterr().out
    assert "Accept length per DP rank: " + ", ".join(f"DP{i} {v:.2f}" for i, v in enumerate(per_rank)) in out
    assert ("WARNING: the DP ranks' accept lengths differ by 1.57 (more than 0.1)" in out) == warned
    assert ("WARNING" in out) == warned


@pytest.mark.parametrize("ratio, low", [(0.0, 1), (0.5, 32)])
def test_bench_serving_random_lengths_follow_the_range_ratio(ratio, low):
    args = bench_serving.get_parser().parse_args(
        ["--num-prompts", "200", "--random-input-len", "64", "--random-output-len", "64", "--random-range-ratio", str(ratio)]
    )
    reqs = bench_serving.random_requests(args, vocab_size=100, rng=random.Random(0))
    for lengths in ([len(r.payload["input_ids"]) for r in reqs], [r.output_len for r in reqs]):
        assert low <= min(lengths) < low + 8 and 56 < max(lengths) <= 64


def test_bench_serving_file_prompts_at_a_request_rate(server, trained, tmp_path):
    heldout = [json.loads(line)["prompt"] for line in open(trained["prompts"])]
    assert heldout and all(heldout)
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": heldout[0][:60]}) + "\n" + json.dumps({"prompt": "def f(x):", "output_len": 2}) + "\n")
    args = bench_serving.get_parser().parse_args(
        [
            "--base-url",
            server.base_url,
            "--dataset-name",
            "file",
            "--dataset-path",
            str(path),
            "--num-prompts",
            "3",
            "--random-output-len",
            "3",
            "--request-rate",
            "20",
            "--flush-cache",
        ]
    )
    m = bench_serving.run_benchmark(args)
    assert m["completed"] == 3 and m["total_output_tokens"] == 3 + 2 + 3 and m["total_input_tokens"] > 3


@pytest.mark.parametrize("tokens_per_step", [1, 4])
def test_serving_pipeline_benchmark_streams_every_token(trained, tmp_path, tokens_per_step):
    """The HTTP server and detokenizer over the paced scheduler stand-in: every request gets
    its tokens (4 per step: a speculative cycle's messages, the last one cut at the output
    length), and the figures are measured (CPU time per token of both processes)."""
    result_file = tmp_path / "pipeline.jsonl"
    cmd = [
        sys.executable,
        os.path.join(REPO, "benchmark/bench_serving_pipeline.py"),
        "--model-path",
        trained["llama"],
        "--step-ms",
        "2",
        "--tokens-per-step",
        str(tokens_per_step),
        "--concurrency",
        "1",
        "3",
        "--num-prompts",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "6",
        "--result-file",
        str(result_file),
    ]
    subprocess.run(cmd, check=True, timeout=300, capture_output=True)
    rows = [json.loads(line) for line in result_file.read_text().splitlines()]
    assert [(r["concurrency"], r["completed"], r["num_prompts"]) for r in rows] == [(1, 1, 1), (3, 6, 6)]
    for r in rows:
        assert r["ideal_tok_s"] == r["concurrency"] * tokens_per_step * 500
        assert 0 < r["output_tok_s"] <= 1.2 * r["ideal_tok_s"] and r["mean_ttft_ms"] > 0
        assert r["http_cpu_us_per_token"] > 0 and r["detokenizer_cpu_us_per_token"] > 0
        assert r["client_cpu_us_per_token"] > 0 and 0 < r["client_cpu_fraction"] <= 1.05


# ---------------------------------------------------------------------------- others
def test_bench_one_batch_on_tiny_llama(trained, tmp_path):
    result_file = str(tmp_path / "one_batch.jsonl")
    rows = bench_one_batch.main(
        [
            "--model-path",
            trained["llama"],
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--batch-size",
            "1",
            "3",
            "--input-len",
            "12",
            "--output-len",
            "4",
            "--result-filename",
            result_file,
        ]
    )
    assert [r["batch_size"] for r in rows] == [1, 3]
    assert all(r["prefill_latency"] > 0 and r["median_decode_throughput"] > 0 for r in rows)
    assert len(open(result_file).read().splitlines()) == 2


def test_spec_sweep_table():
    sweep = _load_script("benchmark/spec_sweep.py")
    assert sweep.parse_config("3,4,8") == (3, 4, 8)
    assert (
        sweep.parse_config("adaptive:1,3,5") == sweep.Adaptive((1, 3, 5)) and sweep.parse_config("adaptive") == sweep.Adaptive()
    )
    args = argparse.Namespace(speculative_algorithm="NEXTN", speculative_draft_model_path=None)
    assert sweep.server_flags(args, sweep.Adaptive((1, 3))) == [
        "--speculative-algorithm",
        "NEXTN",
        "--speculative-adaptive",
        "--speculative-adaptive-steps",
        "1,3",
    ]

    def row(accept, throughput, tpot, concurrency):
        return {"accept_length": accept, "output_throughput": throughput, "median_tpot_ms": tpot, "max_concurrency": concurrency}

    rows = [
        (None, row(None, 100.0, 10.0, 1)),
        (None, row(None, 900.0, 30.0, 32)),
        ((3, 1, 4), row(2.5, 180.0, 5.5, 1)),
        ((3, 1, 4), row(2.5, 1350.0, 20.0, 32)),
        ((1, 1, 2), row(1.7, 150.0, 6.0, 1)),
        (sweep.Adaptive((1, 3)), row(2.4, 171.0, 5.7, 1)),
    ]
    rows[3][1]["prefill_batches"] = 7
    rows[5][1]["tier_cycles"] = {3: 40, 1: 2}
    lines = sweep.table(rows).splitlines()
    assert lines[2] == "| - | - | - | 1 | - | 100.0 | 10.00 | - | 1.00x | - | - |"
    assert lines[4] == "| 3 | 1 | 4 | 1 | 2.50 | 180.0 | 5.50 | - | 1.80x | 1.00x | - |"
    assert lines[5] == "| 3 | 1 | 4 | 32 | 2.50 | 1350.0 | 20.00 | 7 | 1.50x | 1.00x | - |"
    assert lines[6] == "| 1 | 1 | 2 | 1 | 1.70 | 150.0 | 6.00 | - | 1.50x | 0.83x | - |"
    assert lines[7] == "| adaptive 1,3 | 1 | steps + 1 | 1 | 2.40 | 171.0 | 5.70 | - | 1.71x | 0.95x | 1:2 3:40 |"


def test_spec_sweep_reports_the_median_pass():
    sweep = _load_script("benchmark/spec_sweep.py")
    passes = [{"output_throughput": t, "prefill_batches": p} for t, p in [(900.0, 9), (1200.0, 5), (1000.0, 7), (800.0, 11)]]
    median = sweep.median_pass(passes)
    assert median["output_throughput"] == 900.0 and median["prefill_batches"] == 9  # lower middle of four
    assert median["pass_throughputs"] == [900.0, 1200.0, 1000.0, 800.0]
    row = {**sweep.median_pass(passes[:3]), "accept_length": 1.7, "median_tpot_ms": 1.0, "max_concurrency": 32}
    assert (
        sweep.table([((1, 1, 2), row)]).splitlines()[2]
        == "| 1 | 1 | 2 | 32 | 1.70 | 1000.0 (900-1200) | 1.00 | 7 | - | 1.00x | - |"
    )
    with pytest.raises(SystemExit):
        sweep.main(["--model-path", "m", "--speculative-algorithm", "NEXTN", "--configs", "1,1,2", "--recorded-passes", "0"])


def test_spec_sweep_counts_prefill_batches(tmp_path):
    sweep = _load_script("benchmark/spec_sweep.py")
    log = tmp_path / "server.log"
    log.write_text("x Prefill batch. #new-seq: 2\nx Decode batch.\nx Prefill batch. #new-seq: 1\n")
    assert sweep.count_prefill_batches(str(log)) == 2


def test_flag_ab_parses_variants_and_alternates_rounds():
    ab = _load_script("benchmark/flag_ab.py")
    plain, mixed = ab.parse_variant("plain="), ab.parse_variant("mixed=--enable-mixed-chunk --chunked-prefill-size '64'")
    assert plain == ab.Variant("plain", ()) and mixed == ab.Variant(
        "mixed", ("--enable-mixed-chunk", "--chunked-prefill-size", "64")
    )
    assert ab.parse_variant("a=b=c").flags == ("b=c",)
    for bad in ("plain", "=--enable-mixed-chunk"):
        with pytest.raises(argparse.ArgumentTypeError):
            ab.parse_variant(bad)
    assert [[v.name for v in order] for order in ab.round_order([plain, mixed], 3)] == [
        ["plain", "mixed"],
        ["mixed", "plain"],
        ["plain", "mixed"],
    ]
    c = ab.Variant("c", ())
    assert ab.round_order([plain, mixed, c], 2)[1] == [c, mixed, plain]
    for argv in (
        ["--variant", "a="],
        ["--variant", "a=", "--variant", "a=--x"],
        ["--variant", "a=", "--variant", "b=", "--rounds", "0"],
    ):
        with pytest.raises(SystemExit):
            ab.main(["--model-path", "m", *argv])


def test_flag_ab_engines_name_variants_and_packages(tmp_path):
    ab = _load_script("benchmark/flag_ab.py")
    python_dir = os.path.join(REPO, "python")
    assert ab.parse_engine(f"before={python_dir}") == ("before", python_dir)
    for bad in (f"={python_dir}", "before", f"before={tmp_path}"):  # no name, no dir, no sglang package in it
        with pytest.raises(argparse.ArgumentTypeError):
            ab.parse_engine(bad)
    plain, mixed = ab.Variant("plain", ()), ab.Variant("mixed", ("--enable-mixed-chunk",))
    assert ab.with_engines([plain, mixed], [("plain", python_dir)]) == [ab.Variant("plain", (), python_dir), mixed]
    with pytest.raises(ValueError, match="names no variant"):
        ab.with_engines([plain, mixed], [("other", python_dir)])


def test_launch_serves_the_package_of_python_dir(tmp_path):
    """A server started with python_dir imports sglang from there: a package without the
    launcher fails to start, naming the missing module."""
    (tmp_path / "sglang").mkdir()
    (tmp_path / "sglang" / "__init__.py").write_text("")
    with pytest.raises(RuntimeError, match="sglang.launch_server"):
        popen_launch_server("unused", [], timeout=60, python_dir=str(tmp_path))


def test_flag_ab_table_from_the_median_rounds():
    ab = _load_script("benchmark/flag_ab.py")

    def round_metrics(throughput, ttft, prefills, mixed, stalled):
        return {
            "output_throughput": throughput,
            "mean_ttft_ms": ttft,
            "median_itl_ms": 1000 / throughput,
            "p99_itl_ms": 3000 / throughput,
            "median_tpot_ms": 1100 / throughput,
            "prefill_batches": prefills,
            "mixed_prefill_batches": mixed,
            "stalled_iteration_fraction": stalled,
        }

    plain = [
        round_metrics(100.0, 50.0, 40, 0, 0.3),
        round_metrics(125.0, 45.0, 38, 0, 0.25),
        round_metrics(110.0, 48.0, 39, 0, 0.28),
    ]
    mixed = [round_metrics(140.0, 40.0, 41, 30, 0.1), round_metrics(130.0, 42.0, 40, 29, 0.12)]
    rows = [
        (ab.Variant("plain", ()), ab.median_pass(plain)),
        (ab.Variant("mixed", ("--enable-mixed-chunk",)), ab.median_pass(mixed)),
    ]
    lines = ab.table(rows).splitlines()
    assert lines[0].startswith("| variant | server flags | output tok/s (range) | mean TTFT ms |")
    assert lines[2] == "| plain | - | 110.0 (100-125) | 48.0 | 9.09 | 27.27 | 10.00 | 39 | 0 | 0.28 |"
    assert (
        lines[3] == "| mixed | `--enable-mixed-chunk` | 130.0 (130-140) | 42.0 | 7.69 | 23.08 | 8.46 | 40 | 29 | 0.12 |"
    )  # lower middle
    assert "(" not in ab.table([(ab.Variant("one", ()), ab.median_pass(plain[:1]))]).splitlines()[2]
    # One output token per request (a TTFT A/B): no ITL or TPOT.
    ttft_only = {k: v for k, v in plain[0].items() if k not in ("median_itl_ms", "p99_itl_ms", "median_tpot_ms")}
    assert (
        ab.table([(ab.Variant("one", ()), ttft_only)]).splitlines()[2] == "| one | - | 100.0 | 50.0 | - | - | - | 40 | 0 | 0.30 |"
    )
    # An older server that does not report the mixed and stalled counts.
    older = {**plain[0], "mixed_prefill_batches": None, "stalled_iteration_fraction": None}
    assert ab.table([(ab.Variant("old", ()), older)]).splitlines()[2].endswith("| 40 | - | - |")


def test_flag_ab_runs_two_servers(tiny_llama_unsharded_dir, tmp_path):
    """One round of plain against mixed chunks on the tiny Llama: every request completes, and
    only the mixed server's prefills carry decode steps (the prompts take 3 chunks each while
    others decode)."""
    ab = _load_script("benchmark/flag_ab.py")
    out = tmp_path / "ab.json"
    workload = "--rounds 1 --dataset-name random --random-input-len 48 --random-output-len 8 --random-range-ratio 1"
    workload += " --num-prompts 6 --max-concurrency 3 -- --device cpu --dtype float32 --chunked-prefill-size 16"
    result = ab.main(
        ["--model-path", tiny_llama_unsharded_dir, "--variant", "plain=", "--variant", "mixed=--enable-mixed-chunk"]
        + ["--engine", f"mixed={os.path.join(REPO, 'python')}", "--output-file", str(out), *workload.split()]
    )
    assert [line.split(" | ")[0] for line in result.splitlines()[2:]] == ["| plain", "| mixed"]
    variants = {v["name"]: v for v in json.loads(out.read_text())["variants"]}
    assert variants["mixed"]["flags"] == ["--enable-mixed-chunk"]
    assert variants["mixed"]["python_dir"] == os.path.join(REPO, "python") and variants["plain"]["python_dir"] is None
    for v in variants.values():
        (only,) = v["rounds"]
        assert only["round"] == 0 and only["completed"] == 6 and only["total_output_tokens"] == 48
        assert only["prefill_batches"] >= 6 and 0.0 <= only["stalled_iteration_fraction"] <= 1.0
    assert variants["plain"]["median"]["mixed_prefill_batches"] == 0 < variants["mixed"]["median"]["mixed_prefill_batches"]


def test_bench_launch_times_the_wrappers_with_launches_stubbed():
    pytest.importorskip("triton")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmark/kernels/bench_launch.py"),
            "--stub-launch",
            "--calls",
            "5",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.rsplit(None, 1) for line in out.stdout.splitlines()[1:]]
    assert [name.strip() for name, _ in rows][-1] == "fused_moe (4 kernels)" and all(float(us) > 0 for _, us in rows)


def test_host_overhead_counts_ops_by_part():
    """--count-ops: a NEXTN cycle's ops fall to the model, each program's own work and the host."""
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "benchmark/host_overhead.py"),
            "--tiny-deepseek",
            "--batch-sizes",
            "1",
            "--iterations",
            "4",
            "--repeats",
            "1",
            "--warmup",
            "2",
            "--count-ops",
            "--",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--speculative-algorithm",
            "NEXTN",
            "--speculative-num-steps",
            "3",
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    ops = json.loads(out.stdout.strip().splitlines()[-1])["ops_per_iter"]
    assert set(ops) == {"model", "DecodeCycle", "DraftLoop", "VerifyProgram", "DraftExtendProgram", "host"}
    assert ops["DraftExtendProgram"] == 2.0  # the guess of topk 1: its argmax and its score
    assert min(ops.values()) > 0 and ops["model"] > ops["DraftLoop"] > ops["DraftExtendProgram"]


def test_trace_summary_counts_device_busy_time_and_host_calls(tmp_path):
    """Overlapping kernels count once; gaps between them are idle; host calls are per iteration."""
    summary = _load_script("benchmark/trace_summary.py")
    events = [
        {"ph": "X", "cat": "kernel", "name": "a", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "b", "ts": 5, "dur": 10},  # overlaps a: busy 0..15
        {"ph": "X", "cat": "gpu_memcpy", "name": "c", "ts": 115, "dur": 5},  # after a 100 us gap
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1, "dur": 30},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 50, "dur": 10},
        {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 2, "dur": 3},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},
    ]
    path = tmp_path / "t.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    out = summary.summarize(summary.load_events(str(path)), iterations=2)
    assert out["device_span_us_per_iter"] == 60.0 and out["device_busy_us_per_iter"] == 10.0
    assert out["kernels_per_iter"] == 1.0
    assert out["idle_gaps_per_iter"] == {"100-1000us": {"count": 0.5, "us": 50.0}}
    assert out["host_calls_per_iter"] == {"cudaGraphLaunch": {"count": 1.0, "us": 20.0}}


def test_shared_gpu_validation_workload_and_first_difference():
    validate = _load_script("benchmark/gpu/validate_shared_gpu.py")
    items = validate.workload(vocab=256)
    assert len(items) == 32 and items == validate.workload(vocab=256)  # the same prompts every run
    assert {len(ids) for ids, _ in items} <= {1, 5, 17, 40, 120} and all(4 <= n <= 40 for _, n in items)
    reference = [[1, 2, 3], [4, 5, 6]]
    assert validate.first_difference(reference, reference, reference, items) is None
    diff = validate.first_difference(reference, [[1, 2, 3], [4, 9, 6]], reference, items)
    assert diff == {"run": "staggered", "prompt": 1, "prompt_len": len(items[1][0]), "token": 1, "got": [9, 6], "want": [5, 6]}
    assert validate._log_path_of("Server exited with code 1 (log: /tmp/x.log):\ntail") == "/tmp/x.log"


def test_spy_serving_splits_samples_by_process_and_role():
    """py-spy's raw stacks (--subprocesses): each sample counts for the innermost process of
    its stack (a command line may hold semicolons), its top line's own time, and every function
    in it; the entry chain of a process is left out of the callee table."""
    spy = _load_script("benchmark/spy_serving.py")
    main = 'process 10:"python3 -m sglang.launch_server --model-path m"'
    child = 'process 11:"python3 -c from multiprocessing.spawn import spawn_main; spawn_main(pipe_handle=5)"'
    sched = f"{main};{child};run_scheduler_process (sglang/srt/managers/scheduler_process.py:77)"
    raw = [
        f"{sched};Scheduler.launch (sglang/srt/managers/scheduler.py:10);upload (sglang/srt/utils/transfer.py:75) 6\n",
        f"{sched};Scheduler.launch (sglang/srt/managers/scheduler.py:10) 2\n",
        f"{sched};Scheduler.process (sglang/srt/managers/scheduler.py:40) 2\n",
        f"{main};Runner.run (asyncio/runners.py:118) 3\n",
        "\n",
    ]
    processes = spy.parse_raw(raw)
    assert {p.pid: (p.role, p.samples) for p in processes.values()} == {11: ("scheduler", 10), 10: ("HTTP server", 3)}
    scheduler = processes[11]
    assert scheduler.own["upload (sglang/srt/utils/transfer.py:75)"] == 6
    assert scheduler.within["Scheduler.launch (sglang/srt/managers/scheduler.py)"] == 8
    text = spy.report(processes, rows=5)
    assert text.index("== scheduler (pid 11): 10 samples") < text.index("== HTTP server (pid 10): 3 samples")
    assert " 80.0%  Scheduler.launch (sglang/srt/managers/scheduler.py)" in text
    assert "run_scheduler_process" not in text.split("with callees")[1].split("==")[0]  # in every sample


def test_bench_gemv_offers_all_rows_tiles_at_a_few_rows_and_tables_them(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmark/kernels"))  # its sibling graph_timing
    bench = _load_script("benchmark/kernels/bench_gemv.py")
    assert not any(c.all_rows for c in bench.candidates(1)) and not any(c.all_rows for c in bench.candidates(8))
    at_four = bench.candidates(4)
    assert set(bench.ALL_ROWS_CONFIGS) <= set(at_four) and len({str(c) for c in at_four}) == len(at_four)
    all_rows, fma = bench.ALL_ROWS_CONFIGS[0], bench.FMA_CONFIGS[0]
    results = {1: {"cublas": 10.0, str(fma): 8.0, str(all_rows): 9.0}, 4: {"cublas": 10.0, str(fma): 12.0, str(all_rows): 9.0}}
    assert bench.table_entries(results, margin=0.02) == [(1, fma), (4, all_rows)]
    assert eval(bench.config_literal(all_rows), {"GemvConfig": type(all_rows)}) == all_rows


def test_bench_gemv_write_table_replaces_only_the_shapes_measured(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(os.path.join(REPO, "benchmark/kernels"))
    bench = _load_script("benchmark/kernels/bench_gemv.py")
    fma, dot = bench.FMA_CONFIGS[0], bench.DOT_CONFIGS[0]
    stored = {(1, 2, False): ((1, fma),), (3, 4, False): ((32, dot),), (5, 6, True): ((1, fma),)}
    measured = {(3, 4, False): [(1, fma), (4, None)], (5, 6, True): [], (7, 8, False): [(4, dot)]}
    assert bench.merge_tables(stored, measured) == {
        (1, 2, False): ((1, fma),),
        (3, 4, False): ((1, fma), (4, None)),
        (7, 8, False): ((4, dot),),
    }
