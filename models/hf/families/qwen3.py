"""Qwen3 (``Qwen3ForCausalLM``, ``model_type`` ``qwen3``): per-head q/k RMS norms, no
biases; RoPE plain or ``"llama3"``-scaled, embeddings tied or not."""

from models.hf.family import Family, attention, mlp, norms, qk_norms

FAMILY = Family(
    architecture="Qwen3ForCausalLM", model_type="qwen3",
    fixed={"qk_norm": True, "qkv_bias": False}, layer=(norms, attention, qk_norms, mlp),
    write_config=lambda cfg: {"attention_bias": False},
)
