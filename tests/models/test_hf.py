"""Parity with transformers, checkpoint import / export, and checkpoint errors."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import numpy as safetensors_numpy

import jaxhead
from models import CheckpointError, load_config, load_model, save_model
from models.hf import hf_tensors
from tests.support.models import causal_inputs, hf_logits, hf_model, random_tokens

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

CASES = {
    "dense-untied": {"moe": False, "tied": False},
    "dense-tied": {"moe": False, "tied": True},
    "moe-untied": {"moe": True, "tied": False},
    "moe-tied": {"moe": True, "tied": True},
    # layers 0 and 2 sparse, layer 1 dense (mlp_only_layers), layer 3 dense (sparse step 2)
    "moe-mixed": {"moe": True, "tied": False, "num_hidden_layers": 4, "decoder_sparse_step": 1,
                      "mlp_only_layers": [1, 3]},
    # Qwen2 / Qwen2.5: q/k/v biases, no q/k norm; Llama 3: llama3 RoPE scaling, no biases
    "qwen2-tied": {"moe": False, "tied": True, "family": "qwen2"},
    "llama-untied": {"moe": False, "tied": False, "family": "llama"},
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(name) -> (transformers model, directory)``, built once per module."""
    built = {}

    def get(name):
        if name not in built:
            model = hf_model(**CASES[name])
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            built[name] = (model, path)
        return built[name]

    return get


def forward(model, tokens):
    """Our ``(hidden, float32 logits, DecoderOutput)`` on unpacked causal rows."""
    out = model(*causal_inputs(tokens))
    return out.hidden, np.asarray(model.logits(out.hidden)), out


def params_of(model):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


# Qwen2 / Llama: their import parity is the export round trip's (family-independent head)
@pytest.mark.parametrize("name", [n for n, case in CASES.items() if "family" not in case])
def test_logits_and_logprobs_match_transformers(checkpoint, name):
    hf, path = checkpoint(name)
    tokens = random_tokens((2, 16))
    ref = hf_logits(hf, tokens)
    model = load_model(path, dtype="float32")
    hidden, logits, _ = forward(model, tokens)
    labels, valid = jaxhead.next_token_labels(jnp.asarray(tokens))
    head = model.lm_head(hidden, labels, valid)
    ref_logp_all = jax.nn.log_softmax(ref, axis=-1)
    ref_logp = np.take_along_axis(ref_logp_all, np.maximum(np.asarray(labels), 0)[..., None],
                                  -1)[..., 0] * np.asarray(valid)
    ref_ent = -np.sum(np.exp(ref_logp_all) * ref_logp_all, -1) * np.asarray(valid)
    logit_err = np.abs(logits - ref).max()
    logp_err = np.abs(np.asarray(head.logprobs) - ref_logp).max()
    ent_err = np.abs(np.asarray(head.entropy) - ref_ent).max()
    print(f"\n{name}: max|logits| {np.abs(ref).max():.2f}, logits err {logit_err:.2e}, "
          f"logprobs err {logp_err:.2e}, entropy err {ent_err:.2e}")
    assert logit_err <= 1e-4
    assert logp_err <= 1e-4
    assert ent_err <= 1e-4


def test_load_balancing_loss_matches_transformers(checkpoint):
    import torch

    hf, path = checkpoint("moe-untied")
    tokens = random_tokens((2, 16), seed=3)
    with torch.no_grad():
        ref = hf(torch.as_tensor(tokens, dtype=torch.long), output_router_logits=True).aux_loss
    _, _, out = forward(load_model(path, dtype="float32"), tokens)
    np.testing.assert_allclose(float(out.aux_loss), float(ref), rtol=1e-5)


@pytest.mark.parametrize("name, shard_bytes", [("dense-tied", 5 * 2**30),
                                               ("moe-untied", 40_000),
                                               ("qwen2-tied", 5 * 2**30),
                                               ("llama-untied", 60_000)])
def test_export_round_trips_bit_exactly_and_transformers_loads_it(checkpoint, tmp_path, name,
                                                                   shard_bytes):
    """HF checkpoint -> ours -> HF: the same tensors bit for bit, and transformers' logits
    on our export equal ours to 1e-5 (the import parity of the Qwen2 and Llama cases)."""
    hf, path = checkpoint(name)
    model = load_model(path, dtype="float32")
    save_model(model, tmp_path, max_shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes < 2**20)
    again = load_model(tmp_path, dtype="float32")
    before, after = params_of(model), params_of(again)
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key], err_msg=str(key))
    original = safetensors_numpy.load_file(path / "model.safetensors")
    exported = {}
    for file in tmp_path.glob("*.safetensors"):
        exported.update(safetensors_numpy.load_file(file))
    assert original.keys() == exported.keys()
    for key in original:
        np.testing.assert_array_equal(original[key], exported[key], err_msg=key)

    tokens = random_tokens((2, 16), seed=5)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager").float().eval()
    theirs = hf_logits(reloaded, tokens)
    np.testing.assert_array_equal(theirs, hf_logits(hf, tokens))
    assert np.abs(forward(again, tokens)[1] - theirs).max() <= 1e-5


def test_loads_sharded_checkpoint_with_index(checkpoint, tmp_path):
    hf, path = checkpoint("moe-untied")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert (tmp_path / "model.safetensors.index.json").exists()
    sharded = params_of(load_model(tmp_path, dtype="float32"))
    single = params_of(load_model(path, dtype="float32"))
    assert sharded.keys() == single.keys()
    for key in single:
        np.testing.assert_array_equal(sharded[key], single[key], err_msg=str(key))


def test_loads_in_requested_dtype(checkpoint):
    _, path = checkpoint("dense-untied")
    f32 = params_of(load_model(path, dtype="float32"))
    model = load_model(path)  # bf16 compute, f32 params: the default policy
    bf16 = params_of(load_model(path, param_dtype="bfloat16"))
    for key, value in bf16.items():
        assert value.dtype == ml_dtypes.bfloat16, key
        np.testing.assert_array_equal(value, f32[key].astype(ml_dtypes.bfloat16))
    tokens = random_tokens((1, 8))
    hidden, logits, _ = forward(model, tokens)
    assert hidden.dtype == jnp.bfloat16 and logits.dtype == np.float32
    ref = forward(load_model(path, dtype="float32"), tokens)[1]
    assert 0 < np.abs(logits - ref).max() < 0.25  # bf16 compute: close, not equal


def edit_checkpoint(src, dst, *, config=None, drop=None):
    """Copy checkpoint ``src`` to ``dst`` with config.json fields replaced and tensors
    removed."""
    shutil.copytree(src, dst)
    hf_config = json.loads((dst / "config.json").read_text())
    hf_config.update(config or {})
    (dst / "config.json").write_text(json.dumps(hf_config))
    if drop:
        tensors = safetensors_numpy.load_file(dst / "model.safetensors")
        del tensors[drop]
        safetensors_numpy.save_file(tensors, dst / "model.safetensors", {"format": "pt"})
    return dst


@pytest.mark.parametrize("edit, message", [
    ({"config": {"num_key_value_heads": 4}},
     r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape \(32, 64\), expected \(64, 64\)"),
    ({"config": {"vocab_size": 500}},
     r"'model\.embed_tokens\.weight' has shape \(512, 64\), expected \(500, 64\)"),
    ({"config": {"num_hidden_layers": 1}}, r"2? ?tensor\(s\).*'model\.layers\.1\."),
    ({"drop": "model.layers.1.self_attn.v_proj.weight"},
     (r"missing tensor 'model\.layers\.1\.self_attn\.v_proj\.weight' \(expected shape "
     r"\(32, 64\)")),
    ({"config": {"architectures": ["MistralForCausalLM"], "model_type": "mistral"}},
     r"unsupported architecture 'MistralForCausalLM'.*Qwen3ForCausalLM.*LlamaForCausalLM"),
    ({"config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}},
     r"4 tensor\(s\) that config.json does not account for.*q_norm"),  # Llama has no q/k norm
    ({"config": {"attention_bias": True}}, r"unsupported setting attention_bias=True"),
    ({"config": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0}}},
     r"rope_type 'llama3' without \['low_freq_factor', 'high_freq_factor'\]"),
    ({"config": {"use_sliding_window": True}}, r"unsupported setting use_sliding_window"),
    ({"config": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}},
     r"unsupported setting rope_type='yarn'"),
])
def test_bad_checkpoints_raise_with_key_and_shapes(checkpoint, tmp_path, edit, message):
    _, path = checkpoint("dense-untied")
    bad = edit_checkpoint(path, tmp_path / "bad", **edit)
    with pytest.raises(CheckpointError, match=message):
        load_model(bad, dtype="float32")


def test_reads_the_rope_layout_of_transformers_4(checkpoint, tmp_path):
    """A Llama 3.x ``config.json`` as published (transformers 4: ``rope_scaling`` without
    the theta, ``rope_theta`` at the top level) reads as the transformers 5 layout does."""
    _, path = checkpoint("llama-untied")
    hf_config = json.loads((path / "config.json").read_text())
    rope = hf_config.pop("rope_parameters")
    hf_config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    legacy = edit_checkpoint(path, tmp_path / "legacy")
    (legacy / "config.json").write_text(json.dumps(hf_config))
    cfg = load_config(legacy)
    assert cfg == load_config(path)
    assert cfg.rope_parameters == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_moe_expert_count_mismatch_names_the_tensors(checkpoint, tmp_path):
    _, path = checkpoint("moe-untied")
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate\.weight' has shape "
                                              r"\(8, 64\), expected \(4, 64\)"):
        load_model(edit_checkpoint(path, tmp_path / "a", config={"num_experts": 4}))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.0\.mlp\.experts\.8"
                                              r"\.down_proj\.weight' \(expected shape \(64, 32\)"):
        load_model(edit_checkpoint(path, tmp_path / "b", config={"num_experts": 16}))


def test_tied_checkpoint_with_a_different_lm_head_is_rejected(checkpoint, tmp_path):
    _, path = checkpoint("dense-tied")
    bad = edit_checkpoint(path, tmp_path / "bad")
    tensors = safetensors_numpy.load_file(bad / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    safetensors_numpy.save_file(tensors, bad / "model.safetensors", {"format": "pt"})
    load_model(bad, dtype="float32")  # an identical copy of the embedding is accepted
    tensors["lm_head.weight"][0, 0] += 1.0
    safetensors_numpy.save_file(tensors, bad / "model.safetensors", {"format": "pt"})
    with pytest.raises(CheckpointError, match="lm_head.weight differs"):
        load_model(bad, dtype="float32")


def per_expert(tensors):
    """transformers' in-memory fused experts (``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``) as the per-expert checkpoint keys."""
    out = {}
    for key, value in tensors.items():
        prefix, _, name = key.rpartition(".")
        if name == "gate_up_proj":
            parts = dict(zip(("gate_proj", "up_proj"), np.split(value, 2, axis=1), strict=True))
        elif name == "down_proj" and prefix.endswith("experts"):
            parts = {"down_proj": value}
        else:
            out[key] = value
            continue
        for proj, stacked in parts.items():
            out.update({f"{prefix}.{e}.{proj}.weight": w for e, w in enumerate(stacked)})
    return out


def test_gradients_match_transformers(checkpoint):
    """d/dparams of ``sum(a * logprobs) + sum(b * entropy)`` over kept tokens, against torch
    autograd through transformers' logits (float32); MoE with a tied embedding, so the
    router, the experts and both uses of the embedding are covered."""
    name = "moe-tied"
    import torch

    hf, path = checkpoint(name)
    tokens = random_tokens((2, 12), seed=7)
    rng = np.random.default_rng(8)
    a, b = rng.standard_normal((2, *tokens.shape)).astype(np.float32)
    labels, valid = jaxhead.next_token_labels(jnp.asarray(tokens))
    keep = valid & jnp.asarray(rng.random(tokens.shape) < 0.7)

    model = load_model(path, dtype="float32")

    @nnx.jit
    def grads(model):
        def loss(model):
            head, _ = model.token_logprobs(*causal_inputs(tokens), labels, keep)
            return jnp.sum(a * head.logprobs) + jnp.sum(b * head.entropy)
        return nnx.grad(loss)(model)

    ours = hf_tensors(model.cfg, grads(model))

    hf.zero_grad()
    logp_all = torch.log_softmax(hf(torch.as_tensor(tokens, dtype=torch.long)).logits, -1)
    mask = torch.as_tensor(np.asarray(keep, np.float32))
    logp = logp_all.gather(-1, torch.as_tensor(np.maximum(np.asarray(labels), 0),
                                               dtype=torch.long)[..., None])[..., 0]
    ent = -(logp_all.exp() * logp_all).sum(-1)
    (torch.sum(torch.as_tensor(a) * logp * mask) + torch.sum(torch.as_tensor(b) * ent * mask)
     ).backward()
    theirs = per_expert({k: p.grad.numpy() for k, p in hf.named_parameters()})
    if hf.config.tie_word_embeddings:
        theirs.pop("lm_head.weight", None)
    assert ours.keys() == theirs.keys()
    scale = max(np.abs(g).max() for g in theirs.values())
    err = max(np.abs(ours[k] - theirs[k]).max() for k in theirs)
    print(f"\n{name}: max|grad| {scale:.2e}, max grad err {err:.2e}")
    assert err <= 1e-5 * scale
    assert min(np.abs(g).max() for g in theirs.values()) > 0  # every tensor gets gradient
