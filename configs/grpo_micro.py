"""A micro config for tests: a 1-layer width-32 model on the real Qwen vocabulary, a few
SFT and GRPO steps, a small eval set. Runs in well under a minute on 2 CPU cores."""

from train.run.schema import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/grpo_micro"
    c.model.overrides = {
        "vocab_size": 151936, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 16,
    }
    c.data.tasks = ("chain_sum",)
    c.data.task_kwargs = {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1,
                                        "max_digits": 2}}
    c.data.prefill_answer_tag = True  # as in grpo_tiny.py
    c.data.stop_at_close_tag = True
    c.sft.steps = 2
    c.sft.batch_size = 8
    c.sft.row_len = 128
    c.train.steps = 2
    c.train.row_len = 128
    c.rollout.prompts_per_step = 2
    c.rollout.group_size = 4
    c.rollout.max_new_tokens = 6
    c.checkpoint.every = 1
    c.eval.size = 16
    c.eval.samples = 1
    c.eval.batch = 16
    c.eval.curve_every = 1  # the held-out greedy curve at every step (8 problems)
    c.eval.curve_size = 8
    c.metrics.tensorboard = True
    return c
