"""Helpers shared by the tests: the float64 oracle (``oracle``), random models and tiny
Hugging Face checkpoints (``models``), and the multi-device subprocess harness
(``multidevice``)."""

from pathlib import Path

#: The repository root (subprocesses of the tests run there).
ROOT = Path(__file__).resolve().parents[2]
