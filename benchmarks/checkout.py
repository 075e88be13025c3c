"""The checkout's root on ``sys.path``, for the benchmarks run as ``python
benchmarks/<name>.py`` (Python puts this folder first on the path, not the root):
``models``, ``train``, ``harness``, ``configs`` and ``tests`` run from a checkout, and the
wheel holds ``jaxhead`` alone (pyproject.toml). Each benchmark imports this module before
any of them (``import checkout  # noqa: F401``); ``ROOT`` is the root."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
