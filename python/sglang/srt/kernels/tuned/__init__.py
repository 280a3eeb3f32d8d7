"""Kernel configurations measured on a GPU model, one JSON file per (kind, GPU name).

The benchmarks under benchmark/kernels/ write them (`--write-table`); the kernels read the
file of the GPU they run on and fall back to their built-in defaults when there is none.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

_HERE = os.path.dirname(os.path.abspath(__file__))


def table_path(kind: str, device_name: str) -> str:
    """e.g. table_path("gemv", "NVIDIA H200") -> .../tuned/gemv-NVIDIA_H200.json"""
    return os.path.join(_HERE, f"{kind}-{re.sub(r'[^A-Za-z0-9.-]+', '_', device_name)}.json")


def load_table(kind: str, device_name: str) -> Optional[Any]:
    path = table_path(kind, device_name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def write_table(kind: str, device_name: str, table: Any) -> str:
    path = table_path(kind, device_name)
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")
    return path
