"""Helpers of the tests alone: random models and tiny Hugging Face checkpoints
(``models``) and the multi-device subprocess harness (``multidevice``); what the benchmarks
use too is in ``harness/``."""

from pathlib import Path

#: The repository root (subprocesses of the tests run there).
ROOT = Path(__file__).resolve().parents[2]
