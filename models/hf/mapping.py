"""``config.json`` <-> ``ModelConfig`` and our parameter paths <-> HF tensor names, through
the family records (``models.hf.families.FAMILIES``, read at each call).

The fields every family maps the same way are here; what differs is the family's record
(``models.hf.family.Family``).
"""

from __future__ import annotations

import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.hf import families
from models.hf.family import (
    EMBEDDING,
    FINAL_NORM,
    LM_HEAD,
    CheckpointError,
    Family,
    rope_from_hf,
)
from models.hf.layout import Tensor


def family_of_hf(hf: dict) -> Family:
    """The family of a ``config.json`` dict, by ``architectures[0]`` and ``model_type``.

    Raises:
      CheckpointError: no family has both (the supported ones listed).
    """
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    for family in families.FAMILIES:
        if family.architecture == arch and family.model_type == hf.get("model_type"):
            return family
    supported = ", ".join(f"{f.architecture} ({f.model_type})" for f in families.FAMILIES)
    raise CheckpointError(f"unsupported architecture {arch!r} (model_type "
                          f"{hf.get('model_type')!r}); supported: {supported}")


def family_of(cfg: ModelConfig) -> Family:
    """The first family of ``FAMILIES`` that expresses ``cfg`` (``Family.expresses``).

    Raises:
      CheckpointError: none does (the fields the families fix and ``num_experts`` named).
    """
    for family in families.FAMILIES:
        if family.expresses(cfg):
            return family
    fields = dict.fromkeys(k for f in families.FAMILIES for k in f.fixed)
    found = ", ".join(f"{k}={getattr(cfg, k)}" for k in [*fields, "num_experts"])
    raise CheckpointError(f"no Hugging Face architecture has {found}")


def config_from_hf(hf: dict, *, dtype="bfloat16", param_dtype="float32") -> ModelConfig:
    """``ModelConfig`` from the dict of a ``config.json`` of one of ``FAMILIES``.

    Reads ``rope_theta`` and the RoPE type from ``rope_parameters`` (transformers >= 5) or
    ``rope_scaling`` and the top level (``models.hf.family.rope_from_hf``); the family's
    record adds the fields it fixes (Qwen3: q/k norm, no biases; Qwen2: q/k/v biases, no
    q/k norm; Llama: neither) and those it reads (Qwen3-MoE: ``num_experts`` or
    ``num_local_experts``, ...).

    Args:
      hf: the parsed ``config.json``.
      dtype, param_dtype: the dtype policy (see ``ModelConfig``).

    Raises:
      CheckpointError: an architecture no family has, or a feature the decoder does not
        implement (a setting of the family's ``refused``, e.g. an output-projection / MLP
        bias or a sliding window; a RoPE type other than default or ``llama3``; an
        activation other than SiLU), or a config ``ModelConfig`` refuses.
    """
    family = family_of_hf(hf)
    arch = family.architecture
    unsupported = {name: hf.get(name, False) for name in family.refused}
    unsupported["hidden_act"] = hf.get("hidden_act", "silu") != "silu" and hf["hidden_act"]
    for name, value in unsupported.items():
        if value:
            raise CheckpointError(f"{arch}: unsupported setting {name}={value!r}")
    theta, scaling = rope_from_hf(hf, arch)
    heads = hf["num_attention_heads"]
    fields = {
        "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"],
        "intermediate_size": hf.get("intermediate_size", 0),
        "num_hidden_layers": hf["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "max_position_embeddings": hf.get("max_position_embeddings", 40960),
        **family.fixed,
        "dtype": dtype,
        "param_dtype": param_dtype,
        **family.read_config(hf),
    }
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise CheckpointError(f"{arch}: {err}") from err


def architecture(cfg: ModelConfig) -> str:
    """The HF architecture ``cfg`` exports as: that of ``family_of(cfg)`` (q/k norm
    without biases is Qwen3, MoE when it has experts; q/k/v biases without q/k norm
    Qwen2; neither Llama).

    Raises:
      CheckpointError: a combination no family has (q/k norm and biases, or experts
        without the q/k norm of Qwen3-MoE), or a final-logit soft-cap (none of these
        families has one: the export would not reproduce the model).
    """
    if cfg.final_logit_softcapping is not None:
        raise CheckpointError("Qwen / Llama checkpoints have no final-logit soft-cap; cannot "
                              f"export final_logit_softcapping={cfg.final_logit_softcapping}")
    return family_of(cfg).architecture


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    """The ``config.json`` dict transformers reads for ``cfg`` (architecture by
    ``architecture``; RoPE as ``rope_parameters`` and, for readers older than
    transformers 5, ``rope_theta`` / ``rope_scaling``; the tensors' ``dtype`` under both
    names, ``dtype`` as transformers 5 writes and reads it and ``torch_dtype`` for older
    readers; then the family's own fields, ``Family.write_config``).

    Raises:
      CheckpointError: see ``architecture``.
    """
    arch = architecture(cfg)
    family = family_of(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_parameters, "rope_theta": cfg.rope_theta}
    hf = {
        "architectures": [arch], "model_type": family.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
        "hidden_act": "silu", "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": rope, "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_sliding_window": False, "dtype": dtype, "torch_dtype": dtype,
        # the oldest transformers with all four architectures (Qwen3 came in 4.51) reads
        # this layout; without the field transformers 5 warns about the tokenizer's regex
        "transformers_version": "4.51.0",
    }
    if cfg.rope_scaling is not None:
        hf["rope_scaling"] = cfg.rope_parameters
    hf.update(family.write_config(cfg))
    return hf


def tensor_map(cfg: ModelConfig) -> dict[tuple, Tensor]:
    """Our parameter path (as in ``nnx.to_flat_state``) -> its HF storage: the shared
    embedding, final norm and (untied) LM head, and each layer's tensors from its family's
    ``layer``; with ``cfg.scan_layers`` each layer parameter stacks the layers' keys on a
    leading ``[L]`` axis.

    Raises:
      CheckpointError: no family expresses ``cfg`` (see ``family_of``).
    """
    family = family_of(cfg)
    out = {("embed_tokens", "embedding"): Tensor((EMBEDDING,)),
           ("norm", "scale"): Tensor((FINAL_NORM,))}
    if not cfg.tie_word_embeddings:
        out[("lm_head", "kernel")] = Tensor((LM_HEAD,), n_in=1)
    layers = [family.layer_tensors(cfg, i) for i in range(cfg.num_hidden_layers)]
    if not cfg.scan_layers:
        out.update({("layers", i, *path): t for i, layer in enumerate(layers)
                    for path, t in layer.items()})
        return out
    for path, first in layers[0].items():  # identical layers (checked by ModelConfig)
        keys = tuple(key for layer in layers for key in layer[path].keys)
        out[("layers", *path)] = Tensor(keys, first.n_in, first.lead + 1, first.flat)
    return out


def hf_tensors(cfg: ModelConfig, params: nnx.State, dtype=None) -> dict[str, np.ndarray]:
    """HF-named, HF-laid-out numpy tensors of a parameter state.

    Args:
      cfg: the model's config.
      params: ``nnx.state(model, nnx.Param)``, or any state of the same structure (e.g.
        the gradient of a loss w.r.t. the parameters).
      dtype: cast to this dtype; default: keep each array's dtype.

    Returns:
      ``{"model.layers.0.self_attn.q_proj.weight": [N*D, H] array, ...}``; per-expert keys
      for stacked experts; no ``lm_head.weight`` when the embedding is tied.

    Raises:
      CheckpointError: no family expresses ``cfg`` (see ``family_of``).
    """
    tensors = tensor_map(cfg)
    out = {}
    for p, var in nnx.to_flat_state(params):
        value = np.asarray(var[...])
        value = value if dtype is None else value.astype(dtype)
        out.update(zip(tensors[p].keys, tensors[p].to_hf(value)))
    return out
