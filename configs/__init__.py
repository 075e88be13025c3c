"""Trainer configs (ml_collections), one module per run, each with ``get_config()``, as in
the Flax examples: ``python -m train.grpo --config=configs/grpo_tiny.py``.

Every key and its default is in ``train/run/schema.py`` (``base_config()``); a config changes
what its run needs, and may start from another config (``from configs import grpo_tiny``).
``python -m train.grpo --config=configs/x.py --print_config`` shows the resolved values.

  grpo_tiny            the main job: SFT warm start + GRPO of a tiny model, 2 CPU cores
  sft_tiny             its SFT stage alone (``python -m train.sft``)
  grpo_micro           a seconds-long variant for the tests
  grpo_qwen3_0p6b      Qwen3-0.6B from a local HF checkpoint, one host
  grpo_qwen3_30b_a3b   Qwen3-30B-A3B (MoE) on a pod slice / GPU cluster
"""
