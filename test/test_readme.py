"""The README's snippets run as pasted: the server command (its install part left out: the
package is installed already), the curl examples, the Engine script, and the CPU headline
recipe. Only the port (30000 -> a free one) and the recipe's /tmp/tiny (-> a temp dir) change,
so that tests running side by side do not collide."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

from sglang.test.server_utils import find_free_port, kill_server, popen_launch_server

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md")).read()
PYTHON_DIR = os.path.join(REPO, "python")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, re.S)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PYTHON_DIR, env.get("PYTHONPATH")) if p)
    return env


def _bash(script: str, timeout: float) -> str:
    """Run `script` in its own process group, which is killed (server included) if it overruns."""
    proc = subprocess.Popen(
        ["bash", "-c", "set -e\n" + script],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{stdout}{stderr}") from None
    assert proc.returncode == 0, stdout + stderr
    return stdout


def test_engine_snippet_runs_as_a_script(tmp_path):
    (snippet,) = _blocks("python")
    script = tmp_path / "engine_example.py"
    script.write_text(snippet)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), proc.stdout  # the generated text


def test_server_command_and_curls():
    install_and_launch = _blocks("bash")[0].strip()
    launch = install_and_launch.split(" && ")[-1]
    assert launch.startswith("python -m sglang.launch_server ")
    args = launch.split()[3:]
    model = args[args.index("--model-path") + 1]
    proc = popen_launch_server(model, [a for i, a in enumerate(args) if a != "--model-path" and args[i - 1] != "--model-path"])
    try:
        port = proc.base_url.rsplit(":", 1)[1]
        curls = next(b for b in _blocks("bash") if b.startswith("curl"))
        out = _bash(curls.replace("30000", port), timeout=300)
    finally:
        kill_server(proc)
    generate, chat = _json_values(out)
    assert generate["meta_info"]["completion_tokens"] == 16
    assert chat["choices"][0]["message"]["content"] and chat["usage"]["completion_tokens"] <= 32


def test_cpu_headline_recipe(tmp_path):
    recipe = next(b for b in _blocks("bash") if "train_tiny_models" in b)
    script = recipe.replace("30000", str(find_free_port())).replace("/tmp/tiny", str(tmp_path / "tiny"))
    out = _bash(script, timeout=540)
    chat, completions, accept = _json_values(out[out.index("{") :])  # after the training tool's lines
    assert chat["model"] == "tiny-deepseek" and [c["index"] for c in chat["choices"]] == [0, 1, 2, 3]
    assert len(completions["choices"]) == 4
    assert len(accept) == 2 and all(1.0 <= a <= 4.0 for a in accept), accept
    log = (tmp_path / "tiny" / "server.log").read_text()
    assert log.count("--attention-backend flashinfer:") == 1  # the one fallback warning


def _json_values(text: str) -> list:
    """The JSON values printed one after another (curl adds no newline)."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while (pos := _skip_space(text, pos)) < len(text):
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)
    return values


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos
