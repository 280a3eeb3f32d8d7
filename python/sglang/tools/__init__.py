"""Command-line tools (python -m sglang.tools.<name>)."""
