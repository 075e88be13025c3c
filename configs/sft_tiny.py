"""Supervised warm start of the tiny model alone (the SFT stage of ``grpo_tiny.py``):

    python -m train.sft --config=configs/sft_tiny.py

Its checkpoint directory (``runs/sft_tiny/sft``) can start a GRPO run with
``--config.init.sft_checkpoint=runs/sft_tiny/sft --config.sft.steps=0``.
"""

from configs import grpo_tiny


def get_config():
    c = grpo_tiny.get_config()
    c.workdir = "runs/sft_tiny"
    c.train.steps = 0
    return c
