"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``, ``model_type`` ``qwen2``): q/k/v biases (which
transformers' class hard-codes, so ``attention_bias`` is not read), no q/k norm."""

from models.hf.family import Family, attention, mlp, norms, qkv_biases

FAMILY = Family(
    architecture="Qwen2ForCausalLM", model_type="qwen2",
    fixed={"qk_norm": False, "qkv_bias": True}, layer=(norms, attention, qkv_biases, mlp),
    refused=("mlp_bias", "use_sliding_window"),
)
