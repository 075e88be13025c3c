"""Helpers of the tests alone: random models and tiny Hugging Face checkpoints
(``models``), the multi-device subprocess harness (``multidevice``) and the GRPO command
run on a test's config (``trainer``); what the benchmarks
use too is in ``harness/``."""

from pathlib import Path

#: The repository root (subprocesses of the tests run there).
ROOT = Path(__file__).resolve().parents[2]
