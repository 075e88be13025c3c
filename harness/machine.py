"""The machine a measurement ran on, as the benchmarks print it beside their tables."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def describe() -> str:
    """``"<CPU model>, <n> cores"`` (``/proc/cpuinfo``'s model name where there is one)."""
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    model = next((line.split(":", 1)[1].strip() for line in lines
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores"
