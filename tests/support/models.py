"""Helpers for the models tests: random tiny decoders, tiny random transformers checkpoints.

torch / transformers are imported lazily (only by the ``hf_*`` helpers): tests that use
those call ``pytest.importorskip`` first.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig, Transformer

DIMS = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "rope_theta": 10_000.0, "rms_norm_eps": 1e-6}
MOE_DIMS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "norm_topk_prob": True}


def random_model(cfg: ModelConfig, seed: int = 0) -> Transformer:
    """``Transformer(cfg)`` filled with random numpy values (fast: no per-parameter
    initialiser compiles): norm scales ``1 + 0.2 N(0, 1)``, every other weight
    ``0.1 N(0, 1)`` (logits spread over a few nats)."""
    rng = np.random.default_rng(seed)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    flat = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        noise = rng.standard_normal(var.shape)
        value = 1.0 + 0.2 * noise if path[-1] == "scale" else 0.1 * noise
        flat.append((path, jnp.asarray(value, cfg.param_dtype)))
    nnx.update(model, nnx.from_flat_state(flat))
    return model


#: A Llama 3.1 style RoPE scaling whose three bands (kept, interpolated, divided) all hold
#: some of ``DIMS``' 8 frequencies.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
#: family -> transformers (config, model) class names, without and with experts.
FAMILIES = {"qwen3": (("Qwen3Config", "Qwen3ForCausalLM"),
                      ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")),
            "qwen2": (("Qwen2Config", "Qwen2ForCausalLM"), None),
            "llama": (("LlamaConfig", "LlamaForCausalLM"), None)}


def hf_model(moe: bool, tied: bool, seed: int = 0, family: str = "qwen3", **overrides):
    """A random float32 ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` (``family``
    ``"qwen3"``), ``Qwen2ForCausalLM`` (``"qwen2"``, q/k/v biases) or ``LlamaForCausalLM``
    (``"llama"``, with ``LLAMA3_ROPE`` unless ``rope_parameters`` is overridden) with every
    weight randomised (norm scales near 1, projections and biases with std 0.08) so that no
    mapping error can hide behind an identity, a zero bias or a symmetric initialisation."""
    import torch
    import transformers

    torch.manual_seed(seed)
    dims = {**DIMS, **(MOE_DIMS if moe else {}), "tie_word_embeddings": tied, **overrides}
    theta = dims.pop("rope_theta")
    rope = {"rope_type": "default", **(LLAMA3_ROPE if family == "llama" else {})}
    rope = {**rope, "rope_theta": theta, **dims.pop("rope_parameters", {})}
    config_name, model_name = FAMILIES[family][moe]
    config = getattr(transformers, config_name)(**dims, rope_parameters=rope)
    config._attn_implementation = "eager"
    model = getattr(transformers, model_name)(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.08 * torch.randn_like(p))
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    """float32 ``[B, S, V]`` logits of transformers' ``model`` on ``tokens`` (causal)."""
    import torch

    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(tokens), dtype=torch.long)).logits.numpy()


def random_tokens(shape, seed: int = 1, vocab: int = DIMS["vocab_size"]) -> np.ndarray:
    """Random int32 token ids in ``[0, vocab)``."""
    return np.random.default_rng(seed).integers(0, vocab, size=shape).astype(np.int32)


def causal_inputs(tokens: np.ndarray):
    """``(tokens, positions, segment_ids)`` for unpacked rows without padding."""
    tokens = jnp.asarray(tokens)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return tokens, positions, jnp.ones(tokens.shape, jnp.int32)
