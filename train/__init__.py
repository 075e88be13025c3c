"""GRPO / SFT trainer on reasoning-gym tasks with jaxhead for every log-prob.

Entry points: ``python -m train.grpo --config=configs/grpo_tiny.py`` and
``python -m train.sft --config=configs/sft_tiny.py``.
"""
