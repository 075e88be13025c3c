"""Llama 3 (``LlamaForCausalLM``, ``model_type`` ``llama``): no q/k norm, no biases; RoPE
plain or ``"llama3"``-scaled (Llama 3.1 and later)."""

from models.hf.family import Family, attention, mlp, norms

FAMILY = Family(
    architecture="LlamaForCausalLM", model_type="llama",
    fixed={"qk_norm": False, "qkv_bias": False}, layer=(norms, attention, mlp),
    write_config=lambda cfg: {"attention_bias": False, "mlp_bias": False},
)
