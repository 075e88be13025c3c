"""Presets, config validation, and the logical axes of every parameter."""

from __future__ import annotations

import jax
import pytest
from flax import nnx

from models import (
    PRESETS,
    ModelConfig,
    Transformer,
    get_config,
    logical_axes,
    logical_partition_specs,
)
from models.sharding import LOGICAL_AXES

# Published config.json values of the Hugging Face Qwen3 checkpoints.
PUBLISHED = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                       "tie_word_embeddings": True, "num_experts": 0},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                       "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                       "tie_word_embeddings": True, "num_experts": 0},
    "qwen3-30b-a3b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                          "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                          "tie_word_embeddings": False, "num_experts": 128, "num_experts_per_tok": 8,
                          "moe_intermediate_size": 768, "norm_topk_prob": True,
                          "decoder_sparse_step": 1, "mlp_only_layers": ()},
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_published_dimensions(name):
    cfg = get_config(name)
    common = {"vocab_size": 151936, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 40960}
    for field, value in {**common, **PUBLISHED[name]}.items():
        assert getattr(cfg, field) == value, field
    assert cfg.dtype == jax.numpy.bfloat16 and cfg.param_dtype == jax.numpy.float32


def test_qwen3_0p6b_parameter_count():
    model = nnx.eval_shape(lambda: Transformer(get_config("qwen3-0.6b"), rngs=nnx.Rngs(0)))
    count = sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert count == 596_049_920  # the published count (tied embedding counted once)


@pytest.mark.parametrize("preset, count, flags", [
    # the published counts of Qwen2.5-1.5B and Llama-3.2-1B (tied embeddings counted once)
    ("qwen2.5-1.5b", 1_543_714_304, {"qk_norm": False, "qkv_bias": True}),
    ("llama-3.2-1b", 1_235_814_400, {"qk_norm": False, "qkv_bias": False}),
])
def test_qwen2_and_llama3_presets_have_published_parameter_counts(preset, count, flags):
    cfg = get_config(preset)

    def params(layers):  # the identical layers add the same count each (fast: 1 and 2)
        small = cfg.replace(num_hidden_layers=layers, scan_layers=False)
        model = nnx.eval_shape(lambda: Transformer(small, rngs=nnx.Rngs(0)))
        return sum(v.size for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))

    one, two = params(1), params(2)
    assert one + (cfg.num_hidden_layers - 1) * (two - one) == count
    assert {k: getattr(cfg, k) for k in flags} == flags
    assert (cfg.rope_parameters or {}).get("rope_type") == (
        "llama3" if preset.startswith("llama") else None)


@pytest.mark.parametrize("change, message", [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "only rope_type 'llama3'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"missing \['low_freq_factor'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                       "high_freq_factor": 1.0, "original_max_position_embeddings": 64}},
     "high_freq_factor=1.0 must be > low_freq_factor=4.0"),
    ({"num_key_value_heads": 3}, "not a multiple"),
    ({"head_dim": 15}, "even"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"dtype": "float16"}, "float32 or bfloat16"),
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping"),
    ({"hidden_size": 0}, "hidden_size"),
])
def test_invalid_configs_raise(change, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny-moe", **change)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(KeyError, match="qwen3-0.6b"):
        get_config("qwen4")


def test_dtype_names_are_normalised():
    cfg = ModelConfig(**{**vars(PRESETS["tiny"]), "dtype": "float32"})
    assert cfg.dtype == jax.numpy.float32 and cfg == get_config("tiny", dtype=jax.numpy.float32)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_every_parameter_has_logical_axes(preset):
    model = nnx.eval_shape(lambda: Transformer(get_config(preset), rngs=nnx.Rngs(0)))
    axes = logical_axes(model)
    n_params = len(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert len(axes) == n_params
    used = {name for names in axes.values() for name in names}
    # "layers" is the stacked layer axis of scan_layers (tests/models/test_scan_layers.py)
    expected = set(LOGICAL_AXES) - {"layers"} - ({"expert"} if preset == "tiny" else set())
    assert used == expected
    assert axes[("layers", 0, "self_attn", "k_proj")] == ("embed", "kv_heads", "head_dim")
    specs = logical_partition_specs(model)
    spec = specs["layers"][0]["self_attn"]["q_proj"].get_value()
    assert spec == jax.sharding.PartitionSpec("embed", "heads", "head_dim")
    if preset == "tiny-moe":
        assert axes[("layers", 1, "mlp", "down_proj")] == ("expert", "mlp", "embed")


def test_unnamed_parameter_is_reported():
    model = nnx.eval_shape(lambda: Transformer(get_config("tiny"), rngs=nnx.Rngs(0)))
    model.norm.scale = nnx.Param(jax.numpy.ones(model.norm.scale.shape))
    with pytest.raises(ValueError, match="norm/scale"):
        logical_axes(model)
