"""GRPO of Qwen3-30B-A3B (MoE) from a local Hugging Face checkpoint directory:

    python -m train.grpo --config=configs/grpo_qwen3_30b_a3b.py \
        --config.model.hf_checkpoint=/path/to/Qwen3-30B-A3B

``grpo_qwen3_0p6b.py`` scaled up: bf16 compute with float32 parameters (the master
weights) and Adam moments as there, longer prompts and completions,
larger groups, no KL term, the DAPO upper clip; the head accumulates in float32 (jaxhead);
the MoE load-balancing loss is added with the checkpoint's ``router_aux_loss_coef``.

Mesh: experts over ``expert=8``, the other devices on ``fsdp`` (ZeRO-3), e.g. 64 chips of a
pod slice = fsdp=8 x expert=8; launch one process per host (docs/scale-out.md,
"Training on several hosts").
"""

from configs import grpo_qwen3_0p6b


def get_config():
    c = grpo_qwen3_0p6b.get_config()
    c.workdir = "runs/grpo_qwen3_30b_a3b"
    c.data.tasks = ("gsm_symbolic", "basic_arithmetic", "chain_sum")
    c.data.max_prompt_len = 1024
    c.rollout.prompts_per_step = 64
    c.rollout.group_size = 16
    c.rollout.max_new_tokens = 2048
    c.train.row_len = 8192
    c.train.steps = 1000
    c.loss.beta = 0.0
    c.loss.eps_high = 0.28
    c.checkpoint.every = 25
    c.mesh.data = 1
    c.mesh.fsdp = -1  # every device the expert axis leaves
    c.mesh.expert = 8
    c.eval.batch = 256
    return c
