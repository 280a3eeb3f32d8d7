"""SGLang-compatible LLM serving. `sglang.Engine` is imported lazily (it pulls in torch)."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
