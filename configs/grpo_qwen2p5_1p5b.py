"""GRPO of Qwen2.5-1.5B-Instruct (the Qwen2 architecture: q/k/v biases, no q/k norm; its Math
variant and other ChatML checkpoints of that architecture too) from a local Hugging Face
checkpoint directory, with the final policy exported as one:

    python -m train.grpo --config=configs/grpo_qwen2p5_1p5b.py \
        --config.model.hf_checkpoint=/path/to/Qwen2.5-1.5B-Instruct \
        --config.export.hf_dir=runs/grpo_qwen2p5_1p5b/hf

``grpo_qwen3_0p6b.py`` for a model 2.6 times larger: its float32 parameters and Adam state
(24 GB) sharded over every device of the host (``mesh.fsdp=-1``, ZeRO-3) rather than
replicated; the tokenizer is the checkpoint's own ``tokenizer.json``.
"""

from configs import grpo_qwen3_0p6b


def get_config():
    c = grpo_qwen3_0p6b.get_config()
    c.workdir = "runs/grpo_qwen2p5_1p5b"
    c.mesh.data = 1
    c.mesh.fsdp = -1
    return c
