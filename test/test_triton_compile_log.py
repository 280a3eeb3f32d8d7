"""The compile log (utils/triton_compile_log.py) names the kernel variant compiled while serving."""

from __future__ import annotations

import logging
import types

import pytest

from sglang.srt.utils.triton_compile_log import TritonCompileLog


def _fake_compile(log: TritonCompileLog, key: object) -> None:
    """Call the hooks as Triton's JIT does around one compile (triton/runtime/jit.py)."""
    fn = types.SimpleNamespace(name="_align_kernel", jit_function=types.SimpleNamespace(arg_names=["ids", "n", "BLOCK_P"]))
    compile = {"key": key, "constants": {(2,): 1024}, "configs": [{(0,): [["tt.divisibility", 16]]}]}
    assert log._before_compile(key=key, repr="", fn=fn, compile=compile, is_manual_warmup=False, already_compiled=False) is False
    log._after_compile(key=key, repr="", fn=fn, compile=compile, is_manual_warmup=False, already_compiled=False)


def test_compiles_after_startup_are_logged_with_their_constexprs(caplog):
    log = TritonCompileLog()
    _fake_compile(log, "startup")
    with caplog.at_level(logging.INFO, logger="sglang.srt.utils.triton_compile_log"):
        log.start_serving()
        _fake_compile(log, "serving")
    assert log.count == 2
    assert "1 kernel variants during startup" in caplog.records[0].getMessage()
    warning = caplog.records[1]
    assert warning.levelno == logging.WARNING
    assert "_align_kernel(BLOCK_P=1024, aligned=['ids']) while serving" in warning.getMessage()


def test_install_sets_the_jit_hooks():
    knobs = pytest.importorskip("triton").knobs
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        log = TritonCompileLog()
        assert log.install()
        assert knobs.runtime.jit_cache_hook == log._before_compile
        assert knobs.runtime.jit_post_compile_hook == log._after_compile
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved
