"""GRPO of Qwen3-0.6B on one host from a local Hugging Face checkpoint directory:

    python -m train.grpo --config=configs/grpo_qwen3_0p6b.py \
        --config.model.hf_checkpoint=/path/to/Qwen3-0.6B

The tokenizer is the checkpoint's own ``tokenizer.json`` (same directory unless
``--config.tokenizer`` says otherwise). bf16 compute, float32 parameters and optimiser
state; the head accumulates in float32 (jaxhead).
"""

from train.run.schema import base_config


def get_config():
    c = base_config()
    c.workdir = "runs/grpo_qwen3_0p6b"
    c.model.hf_checkpoint = ""  # required: set it with --config.model.hf_checkpoint=DIR
    c.model.dtype = "bfloat16"
    c.model.remat = True  # activations of one layer at a time in the backward pass
    c.model.param_dtype = "float32"
    c.tokenizer = ""  # "" = the checkpoint directory's tokenizer.json
    c.data.tasks = ("chain_sum", "basic_arithmetic", "gsm_symbolic")
    c.data.max_prompt_len = 512
    c.rollout.prompts_per_step = 32
    c.rollout.group_size = 8
    c.rollout.max_new_tokens = 512
    c.train.row_len = 2048
    c.train.steps = 500
    c.train.optim.lr = 1e-6
    c.train.optim.warmup_steps = 20
    c.train.optim.decay = "constant"
    c.loss.beta = 0.001
    c.loss.aggregation = "token-mean"
    c.checkpoint.every = 50
    c.eval.size = 1024
    c.eval.samples = 1
    c.eval.batch = 128
    return c
