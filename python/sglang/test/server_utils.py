"""Launch a real server in a subprocess for tests, and end it without leaving processes."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Optional

import requests

from sglang.srt.utils.process import kill_process_tree, pid_alive, set_parent_death_signal

_PYTHON_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ephemeral_ports_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_free_port(span: int = 1) -> int:
    """A free port on 127.0.0.1 (and the span - 1 after it), below the kernel's ephemeral range:
    a port the kernel hands out (to gloo's sockets, say) could be taken by the server's own
    processes before the server binds it."""
    top = _ephemeral_ports_start() - span
    for _ in range(1000):
        port = random.randrange(10000, top)
        if all(_bindable(p) for p in range(port, port + span)):
            return port
    raise RuntimeError(f"no {span} free consecutive ports in [10000, {top + span})")


class ServerProcess(subprocess.Popen):
    """A `python -m sglang.launch_server` child; its output goes to `log_path`."""

    base_url: str
    log_path: str
    api_key: Optional[str]

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, n: int = 4000) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-n:]


def popen_launch_server(
    model_path: str,
    extra_args: Sequence[str] = (),
    timeout: float = 300.0,
    api_key: Optional[str] = None,
    launcher: Sequence[str] = ("-m", "sglang.launch_server"),
    python_dir: Optional[str] = None,
) -> ServerProcess:
    """Start a server on a free port and wait until /health answers 200. `launcher`: the
    interpreter's arguments before the server flags (another entry point that takes them).
    `python_dir`: the directory whose `sglang` package serves (another checkout's `python/`),
    instead of this one's. The server gets SIGTERM when the calling thread ends. Raises
    RuntimeError (with the server's log tail) if it exits or times out first."""
    port = find_free_port()
    args = [sys.executable, *launcher, "--model-path", model_path, "--port", str(port), *extra_args]
    if api_key:
        args += ["--api-key", api_key]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_dir or _PYTHON_DIR, env.get("PYTHONPATH")) if p)
    log = tempfile.NamedTemporaryFile("w", prefix="sglang-server-", suffix=".log", delete=False)
    # SIGTERM when the calling thread ends, however it ends: a script killed by `timeout` leaves
    # no server behind holding the GPU (the server then ends its own children). So a server
    # must be launched from a thread that outlives it (the main thread in every caller).
    proc = ServerProcess(
        args, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=lambda: set_parent_death_signal(signal.SIGTERM)
    )
    log.close()
    proc.base_url, proc.log_path, proc.api_key = f"http://127.0.0.1:{port}", log.name, api_key
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"Server exited with code {proc.returncode} (log: {proc.log_path}):\n{proc.log_tail()}")
        try:
            if requests.get(f"{proc.base_url}/health", headers=proc.headers(), timeout=5).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        time.sleep(0.5)
    kill_server(proc)
    raise RuntimeError(f"Server not healthy after {timeout} s:\n{proc.log_tail()}")


def kill_server(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    """SIGTERM the server and wait for it; force-kill its whole tree if it does not exit."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc.pid, include_parent=True)
            proc.wait()


def wait_until_gone(pids: Sequence[int], timeout: float = 10.0) -> list[int]:
    """The pids still alive after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if pid_alive(p)]
        time.sleep(0.1)
    return alive
