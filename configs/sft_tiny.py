"""Supervised warm start of the tiny model alone (the SFT stage of ``grpo_tiny.py``):

    python -m train.sft --config=configs/sft_tiny.py

Its checkpoint directory (``runs/sft_tiny/sft``) can start a GRPO run with
``--config.init.sft_checkpoint=runs/sft_tiny/sft --config.sft.steps=0``.
"""

import importlib.util
from pathlib import Path


def get_config():
    path = Path(__file__).with_name("grpo_tiny.py")
    spec = importlib.util.spec_from_file_location("grpo_tiny", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.workdir = "runs/sft_tiny"
    c.train.steps = 0
    return c
