"""Hugging Face checkpoints: load a local ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` /
``Qwen2ForCausalLM`` (Qwen2, Qwen2.5 and their derivatives) / ``LlamaForCausalLM`` (Llama 3)
directory into a ``Transformer`` and export one back (``config.json`` + safetensors).

Tensor layout: HF linear weights are ``[out, in]``; ours are ``[in..., out...]`` with the
head dimensions split (``q_proj`` ``[H, N, D]``, ``o_proj`` ``[N, D, H]``) and MoE
experts stacked on a leading ``[E]`` axis (HF stores ``mlp.experts.{e}.*`` per expert, the
layout the export writes; the import also reads transformers 5's fused
``mlp.experts.gate_up_proj`` / ``down_proj``).
With ``ModelConfig.scan_layers`` the layers are stacked too, on a leading ``[L]`` axis
before the expert one (HF stores ``model.layers.{i}.*`` per layer). Qwen2's q/k/v biases
are ``[N, D]`` / ``[K, D]`` here, flat ``[N*D]`` / ``[K*D]`` in the files.

Import on a mesh (``load_params`` with shardings, ``load_model(mesh=...)``): each process
reads from the files only the slices of the parameters its own devices hold
(``safe_open(...).get_slice``), mapped through those transposes and stackings.

Export from a mesh (``save_params``): the files are split into shards and shard ``s`` is
written by process ``s % process_count``; see ``save_params`` for what moves between the
processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from models import export_dir
from models.config import LLAMA3_ROPE_KEYS, ModelConfig
from models.export_dir import INDEX_FILE
from models.sharding import state_shardings
from models.transformer import Transformer

#: Supported ``architectures[0]`` of ``config.json`` and their ``model_type``.
ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe",
                 "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unsupported architecture or feature, missing,
    unexpected or mis-shaped tensor (the message names the key and both shapes)."""


def _rope(hf: dict, arch: str) -> tuple[float, tuple | None]:
    """``(rope_theta, rope_scaling)`` of a ``config.json``: ``rope_parameters``
    (transformers >= 5) or the older ``rope_scaling`` + top-level ``rope_theta``."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", hf.get("rope_theta", 10_000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise CheckpointError(f"{arch}: unsupported setting rope_type={rope_type!r}")
    scaling = {k: rope.get(k) for k in LLAMA3_ROPE_KEYS}
    if scaling["original_max_position_embeddings"] is None:  # transformers' fallback
        scaling["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    missing = [k for k, v in scaling.items() if v is None]
    if missing:
        raise CheckpointError(f"{arch}: rope_type 'llama3' without {missing}")
    return theta, {"rope_type": "llama3", **scaling}


def config_from_hf(hf: dict, *, dtype="bfloat16", param_dtype="float32") -> ModelConfig:
    """``ModelConfig`` from the dict of a Qwen3 / Qwen3-MoE / Qwen2 / Llama ``config.json``.

    Reads ``rope_theta`` and the RoPE type from ``rope_parameters`` (transformers >= 5) or
    ``rope_scaling`` and the top level, and ``num_experts`` or ``num_local_experts``.
    Qwen3: q/k norm, no biases; Qwen2: q/k/v biases, no q/k norm; Llama: neither, RoPE
    plain or ``"llama3"``-scaled.

    Args:
      hf: the parsed ``config.json``.
      dtype, param_dtype: the dtype policy (see ``ModelConfig``).

    Raises:
      CheckpointError: an architecture other than ``ARCHITECTURES``, or a feature the
        decoder does not implement (an output-projection / MLP bias, sliding window, a RoPE
        type other than default or ``llama3``, an activation other than SiLU).
    """
    archs = hf.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES or hf.get("model_type") != ARCHITECTURES[arch]:
        raise CheckpointError(
            f"unsupported architecture {arch!r} (model_type {hf.get('model_type')!r}); "
            f"supported: {', '.join(f'{a} ({t})' for a, t in ARCHITECTURES.items())}"
        )
    unsupported = {
        # Qwen2 hard-codes q/k/v biases (and none on o_proj); elsewhere the flag means all four
        "attention_bias": arch != "Qwen2ForCausalLM" and hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "use_sliding_window": hf.get("use_sliding_window", False),
        "hidden_act": hf.get("hidden_act", "silu") != "silu" and hf["hidden_act"],
    }
    for name, value in unsupported.items():
        if value:
            raise CheckpointError(f"{arch}: unsupported setting {name}={value!r}")
    theta, scaling = _rope(hf, arch)
    heads = hf["num_attention_heads"]
    qwen3 = arch.startswith("Qwen3")
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
        "qk_norm": qwen3,
        "qkv_bias": arch == "Qwen2ForCausalLM",
        "dtype": dtype,
        "param_dtype": param_dtype,
    }
    if arch == "Qwen3MoeForCausalLM":
        fields.update(
            num_experts=hf.get("num_experts", hf.get("num_local_experts")),
            num_experts_per_tok=hf["num_experts_per_tok"],
            moe_intermediate_size=hf["moe_intermediate_size"],
            norm_topk_prob=hf.get("norm_topk_prob", False),
            decoder_sparse_step=hf.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            router_aux_loss_coef=hf.get("router_aux_loss_coef", 0.001),
        )
    try:
        return ModelConfig(**fields)
    except ValueError as err:
        raise CheckpointError(f"{arch}: {err}") from err


def architecture(cfg: ModelConfig) -> str:
    """The HF architecture ``cfg`` exports as: q/k norm without biases is Qwen3 (MoE when
    it has experts), q/k/v biases without q/k norm Qwen2, neither Llama.

    Raises:
      CheckpointError: a combination no HF architecture has (q/k norm and biases, or
        experts without the q/k norm of Qwen3-MoE), or a final-logit soft-cap (none of
        these families has one: the export would not reproduce the model).
    """
    if cfg.final_logit_softcapping is not None:
        raise CheckpointError("Qwen / Llama checkpoints have no final-logit soft-cap; cannot "
                              f"export final_logit_softcapping={cfg.final_logit_softcapping}")
    if cfg.qk_norm and not cfg.qkv_bias:
        return "Qwen3MoeForCausalLM" if cfg.num_experts else "Qwen3ForCausalLM"
    if not cfg.num_experts and cfg.qkv_bias and not cfg.qk_norm:
        return "Qwen2ForCausalLM"
    if not cfg.num_experts and not cfg.qkv_bias and not cfg.qk_norm:
        return "LlamaForCausalLM"
    raise CheckpointError(f"no Hugging Face architecture has qk_norm={cfg.qk_norm}, "
                          f"qkv_bias={cfg.qkv_bias}, num_experts={cfg.num_experts}")


def config_to_hf(cfg: ModelConfig, dtype: str) -> dict:
    """The ``config.json`` dict transformers reads for ``cfg`` (architecture by
    ``architecture``; RoPE as ``rope_parameters`` and, for readers older than
    transformers 5, ``rope_theta`` / ``rope_scaling``; the tensors' ``dtype`` under both
    names, ``dtype`` as transformers 5 writes and reads it and ``torch_dtype`` for older
    readers).

    Raises:
      CheckpointError: see ``architecture``.
    """
    arch = architecture(cfg)
    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        rope = {**cfg.rope_parameters, "rope_theta": cfg.rope_theta}
    hf = {
        "architectures": [arch], "model_type": ARCHITECTURES[arch], "vocab_size": cfg.vocab_size,
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
    if arch != "Qwen2ForCausalLM":
        hf["attention_bias"] = False
    if arch == "LlamaForCausalLM":
        hf["mlp_bias"] = False
    if cfg.num_experts:
        hf.update(
            num_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob, decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    return hf


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[range]:
    """``index`` (one ``slice`` per axis of ``shape``, as ``jax.make_array_from_callback``
    passes) as one ``range`` per axis, with a step of 1."""
    out = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
    if any(r.step != 1 for r in out):
        raise ValueError(f"strided index {index} of an array of shape {shape}")
    return out


def _runs(ranges: list[range], shape: tuple[int, ...]) -> list[slice]:
    """The contiguous runs, in row-major order, of the flat (row-major) positions that the
    block ``ranges`` of an array of ``shape`` covers: one run when every axis after the
    first partly taken one is whole (e.g. heads split, ``head_dim`` whole), else one per
    index of the axes before the last partly taken one."""
    cut = max((k for k, (r, n) in enumerate(zip(ranges, shape)) if len(r) != n), default=-1)
    if cut < 0:
        return [slice(0, math.prod(shape))]
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    out = []
    for outer in itertools.product(*ranges[:cut]):
        base = sum(i * s for i, s in zip(outer, strides))
        out.append(slice(base + ranges[cut].start * strides[cut],
                         base + ranges[cut].stop * strides[cut]))
    return out


@dataclasses.dataclass(frozen=True)
class _Tensor:
    """How one of our parameters is stored: HF key(s), and for kernels how many axes of
    ours (after the stacked ones) are input axes (HF stores ``[prod(out), prod(in)]``).
    Several keys are stacked on our ``lead`` leading axes (layers and / or experts), in
    row-major order of those axes. ``flat``: stored as one vector (a bias ``[N, D]`` as
    ``[N*D]``)."""

    keys: tuple[str, ...]
    n_in: int | None = None
    lead: int = 0
    flat: bool = False

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        inner = shape[self.lead:]
        if self.flat:
            return (math.prod(inner),)
        if self.n_in is None:
            return tuple(inner)
        return (math.prod(inner[self.n_in:]), math.prod(inner[:self.n_in]))

    def read(self, get, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of our ``shape``-d parameter, in the file dtype.

        Reads exactly the file slices the block needs through ``get(key, hf_index)``
        (``hf_index`` a tuple of ``slice`` s of the HF tensor ``key``): the stacked keys
        the leading ranges select, and of each the rows / columns the inner ranges map to
        (the block of a transposed, head-split kernel is one rectangle of the HF ``[out,
        in]`` matrix unless a split axis follows a partly taken one, e.g. ``head_dim``
        sharded, then several).
        """
        ranges = _ranges(index, shape)
        lead, inner = shape[:self.lead], shape[self.lead:]
        outer, within = ranges[:self.lead], ranges[self.lead:]
        strides = [math.prod(lead[k + 1:]) for k in range(self.lead)]
        keys = [self.keys[sum(i * s for i, s in zip(pos, strides))]
                for pos in itertools.product(*outer)]
        parts = []
        for key in keys:
            if self.flat:
                block = np.concatenate([get(key, (r,)) for r in _runs(within, inner)])
                parts.append(block.reshape([len(r) for r in within]))
                continue
            if self.n_in is None:
                parts.append(get(key, tuple(slice(r.start, r.stop) for r in within)))
                continue
            rows = _runs(within[self.n_in:], inner[self.n_in:])
            cols = _runs(within[:self.n_in], inner[:self.n_in])
            block = np.concatenate([np.concatenate([get(key, (r, c)) for c in cols], axis=1)
                                    for r in rows])
            parts.append(block.T.reshape([len(r) for r in within]))
        return np.stack(parts).reshape([len(r) for r in ranges]) if self.lead else parts[0]

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        parts = list(value.reshape(-1, *value.shape[self.lead:])) if self.lead else [value]
        if self.flat:
            parts = [p.reshape(-1) for p in parts]
        elif self.n_in is not None:
            parts = [p.reshape(math.prod(p.shape[:self.n_in]), -1).T for p in parts]
        return [np.ascontiguousarray(p) for p in parts]


def _layer_tensors(cfg: ModelConfig, i: int) -> dict[tuple, _Tensor]:
    """Path within decoder layer ``i`` -> its HF storage."""
    pre = f"model.layers.{i}."
    out = {}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[(norm, "scale")] = _Tensor((f"{pre}{norm}.weight",))
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        n_in = 2 if proj == "o_proj" else 1
        out[("self_attn", proj)] = _Tensor((f"{pre}self_attn.{proj}.weight",), n_in=n_in)
    for norm in ("q_norm", "k_norm") if cfg.qk_norm else ():
        out[("self_attn", norm, "scale")] = _Tensor((f"{pre}self_attn.{norm}.weight",))
    for proj in ("q", "k", "v") if cfg.qkv_bias else ():
        out[("self_attn", f"{proj}_bias")] = _Tensor((f"{pre}self_attn.{proj}_proj.bias",),
                                                     flat=True)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if cfg.is_moe_layer(i):
            keys = tuple(f"{pre}mlp.experts.{e}.{proj}.weight" for e in range(cfg.num_experts))
            out[("mlp", proj)] = _Tensor(keys, n_in=1, lead=1)
        else:
            out[("mlp", proj)] = _Tensor((f"{pre}mlp.{proj}.weight",), n_in=1)
    if cfg.is_moe_layer(i):
        out[("mlp", "router")] = _Tensor((f"{pre}mlp.gate.weight",), n_in=1)
    return out


def _tensor_map(cfg: ModelConfig) -> dict[tuple, _Tensor]:
    """Our parameter path (as in ``nnx.to_flat_state``) -> its HF storage."""
    out = {
        ("embed_tokens", "embedding"): _Tensor(("model.embed_tokens.weight",)),
        ("norm", "scale"): _Tensor(("model.norm.weight",)),
    }
    if not cfg.tie_word_embeddings:
        out[("lm_head", "kernel")] = _Tensor(("lm_head.weight",), n_in=1)
    layers = [_layer_tensors(cfg, i) for i in range(cfg.num_hidden_layers)]
    if not cfg.scan_layers:
        out.update({("layers", i, *path): t for i, layer in enumerate(layers)
                    for path, t in layer.items()})
        return out
    for path, first in layers[0].items():  # identical layers (checked by ModelConfig)
        keys = tuple(key for layer in layers for key in layer[path].keys)
        out[("layers", *path)] = _Tensor(keys, first.n_in, first.lead + 1, first.flat)
    return out


def _key_files(path: Path) -> dict[str, Path]:
    """Tensor key -> safetensors file, from the index or from the files' headers."""
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    out = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key in out:
                    raise CheckpointError(f"tensor {key!r} is in both {out[key]} and {file}")
                out[key] = file
    return out


def load_config(path, *, dtype="bfloat16", param_dtype="float32",
                scan_layers: bool = False) -> ModelConfig:
    """``config_from_hf`` of ``path/config.json``, with ``scan_layers`` set (the stacked
    layer layout, see ``ModelConfig``).

    Raises:
      FileNotFoundError: no ``config.json``. CheckpointError: see ``config_from_hf``.
      ValueError: ``scan_layers`` with mixed dense / MoE layers (see ``ModelConfig``).
    """
    hf = json.loads((Path(path) / "config.json").read_text())
    return config_from_hf(hf, dtype=dtype, param_dtype=param_dtype).replace(
        scan_layers=scan_layers)


#: transformers 5's fused experts of one MoE layer: ``gate_up_proj`` ``[E, 2I, H]`` (each
#: expert's gate rows, then its up rows) and ``down_proj`` ``[E, H, I]``.
_FUSED_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)")


@dataclasses.dataclass(frozen=True)
class _Fused:
    """Where a per-expert key (``...experts.{e}.gate_proj.weight``, ``[I, H]``) lies in a
    fused tensor: ``fused[expert, offset:offset + rows, :]``."""

    key: str
    expert: int
    offset: int

    def read(self, handle, index: tuple[slice, slice]) -> np.ndarray:
        """The block ``index`` (rows, columns of the per-expert matrix) of the expert."""
        rows, cols = index
        block = (slice(self.expert, self.expert + 1),
                 slice(rows.start + self.offset, rows.stop + self.offset), cols)
        return handle.get_slice(self.key)[block][0]


def _fused_experts(cfg: ModelConfig, handles, key_files: dict[str, Path]) -> dict[str, _Fused]:
    """Per-expert key -> its place in a fused tensor, for every fused expert tensor of the
    files (transformers 5's layout, ``_FUSED_EXPERTS``), its shape checked against
    ``cfg``.

    Raises:
      CheckpointError: a fused tensor of the wrong shape (key, file, both shapes named),
        or experts stored both fused and per expert (both keys named).
    """
    out = {}
    e_, i_, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for key, file in key_files.items():
        match = _FUSED_EXPERTS.fullmatch(key)
        if not match or not e_:
            continue
        prefix, name = match.groups()
        shape, parts = {"gate_up_proj": ((e_, 2 * i_, h), (("gate_proj", 0), ("up_proj", i_))),
                        "down_proj": ((e_, h, i_), (("down_proj", 0),))}[name]
        found = tuple(handles[file].get_slice(key).get_shape())
        if found != shape:
            raise CheckpointError(f"{file}: fused experts tensor {key!r} has shape {found}, "
                                  f"expected {shape} from config.json")
        for e in range(e_):
            for proj, offset in parts:
                alias = f"{prefix}.{e}.{proj}.weight"
                if alias in key_files:
                    raise CheckpointError(f"{file}: experts stored both fused and one by one: "
                                          f"{key!r} and {alias!r}")
                out[alias] = _Fused(key, e, offset)
    return out


def _check_tensors(path: Path, handles, key_files: dict[str, Path],
                   expected: dict[str, tuple[int, ...]], fused: dict[str, _Fused]) -> None:
    """Raise unless the files hold exactly the ``expected`` keys with these shapes (read
    from the files' headers only), an expert's either itself or in a fused tensor."""
    missing = [key for key in expected if key not in key_files and key not in fused]
    if missing:
        first = missing[0]
        hint = ""
        if ".mlp.experts." in first:
            prefix = first.split(".mlp.experts.")[0]
            hint = (f" or fused as {prefix}.mlp.experts.gate_up_proj / "
                    f"{prefix}.mlp.experts.down_proj")
        raise CheckpointError(
            f"{path}: missing tensor {first!r} (expected shape {expected[first]} "
            f"from config.json{hint}); {len(missing)} missing in all"
        )
    for key, shape in expected.items():
        if key in fused:
            continue  # the fused tensor's shape is checked by _fused_experts
        found = tuple(handles[key_files[key]].get_slice(key).get_shape())
        if found != shape:
            raise CheckpointError(f"{key_files[key]}: tensor {key!r} has shape {found}, "
                                  f"expected {shape} from config.json")
    used = {f.key for alias, f in fused.items() if alias in expected}
    extra = sorted(set(key_files) - set(expected) - used)
    if extra:
        raise CheckpointError(
            f"{path}: {len(extra)} tensor(s) that config.json does not account for, "
            f"e.g. {extra[:3]}"
        )


def load_params(path, cfg: ModelConfig, shardings=None) -> dict[tuple, jax.Array]:
    """The parameters of ``Transformer(cfg)`` from a local HF checkpoint directory, each
    built by ``jax.make_array_from_callback`` in its ``sharding``: a process reads from the
    files only the slices its own devices hold (each distinct slice once), never a whole
    tensor unless one of its devices holds all of it (replicated ones, e.g. the norms on a
    mesh without ``fsdp``). A slice of a stacked (``[L]`` layers, ``[E]`` experts) or
    transposed, head-split kernel is read as the matching slices of the stacked files'
    tensors (see ``_Tensor.read``). Tensors of any float dtype are converted to
    ``cfg.param_dtype`` (bfloat16 rounds to nearest even).

    A Qwen3-MoE layer's experts are read in either layout, per expert
    (``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj`` ``[H,
    I]``: what transformers 4 and 5 write and vLLM reads) or fused as transformers 5 holds
    them in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, each expert's gate rows
    then its up rows, and ``mlp.experts.down_proj`` ``[E, H, I]``); a slice of an expert
    is then read from the fused tensor's rows.

    Args:
      path: the checkpoint directory: ``model.safetensors``, several ``*.safetensors``, or
        shards listed by ``model.safetensors.index.json`` (``config.json`` is not read:
        ``cfg`` describes the model, e.g. ``load_config(path)``).
      cfg: the model's config.
      shardings: parameter path (as in ``nnx.to_flat_state``) -> ``jax.sharding.Sharding``
        (e.g. ``models.state_shardings`` over a mesh, which may span several processes);
        None: every parameter whole on the default device ``jax.local_devices()[0]``.

    Returns:
      ``{path: jax.Array}`` of every parameter, its shape in our layout (e.g. ``q_proj``
      ``[H, N, D]``, or ``[L, H, N, D]`` with ``cfg.scan_layers``), dtype
      ``cfg.param_dtype``.

    Raises:
      CheckpointError: a tensor the config requires is missing (key and expected shape
        named; an expert's in neither layout); a tensor's shape disagrees with the config
        (key, file, expected and found shapes named); experts stored in both layouts;
        tensors the model does not use; ``lm_head.weight`` present in a
        tied checkpoint but different from the embedding (each process compares the
        slices it reads).
      KeyError: ``shardings`` lacks a parameter (its path named).
    """
    path = Path(path)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    tensors = _tensor_map(cfg)
    expected = {key: t.hf_shape(var.shape) for p, var in params
                for t in [tensors[p]] for key in t.keys}
    key_files = _key_files(path)
    tied_head = cfg.tie_word_embeddings and "lm_head.weight" in key_files
    if tied_head:
        expected["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    dtype = jnp.dtype(cfg.param_dtype)
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    out = {}
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="np"))
                   for file in sorted(set(key_files.values()))}
        fused = _fused_experts(cfg, handles, key_files)
        _check_tensors(path, handles, key_files, expected, fused)

        def get(key: str, index: tuple[slice, ...]) -> np.ndarray:
            if key in fused:
                return fused[key].read(handles[key_files[fused[key].key]], index)
            return handles[key_files[key]].get_slice(key)[index]

        for p, var in params:
            t, shape, cache = tensors[p], tuple(var.shape), {}
            check_tied = tied_head and p == ("embed_tokens", "embedding")

            def block(index, t=t, shape=shape, cache=cache, check_tied=check_tied):
                where = tuple((r.start, r.stop) for r in _ranges(index, shape))
                if where not in cache:
                    value = t.read(get, shape, index)
                    if check_tied and not np.array_equal(
                            value, _Tensor(("lm_head.weight",)).read(get, shape, index)):
                        raise CheckpointError(f"{path}: tie_word_embeddings is true but "
                                              "lm_head.weight differs from "
                                              "model.embed_tokens.weight")
                    cache[where] = value.astype(dtype)
                return cache[where]

            if shardings is not None and p not in shardings:
                raise KeyError(f"no sharding for parameter {'/'.join(map(str, p))}")
            sharding = default if shardings is None else shardings[p]
            out[p] = jax.make_array_from_callback(shape, sharding, block)
    return out


def load_model(path, *, dtype="bfloat16", param_dtype="float32", scan_layers: bool = False,
               mesh: Mesh | None = None, rules=None) -> Transformer:
    """A ``Transformer`` with the weights of a local HF checkpoint directory
    (``load_config`` + ``load_params``). Parameters are never randomly initialised (the
    model is built abstractly, then filled).

    Args:
      path: the checkpoint directory (``config.json`` plus safetensors, see
        ``load_params``).
      dtype: compute dtype; param_dtype: parameter dtype (float32 or bfloat16 each).
      scan_layers: build the stacked-layer model (``ModelConfig.scan_layers``); the
        per-layer HF tensors are stacked on its leading ``[L]`` axis.
      mesh: place every parameter on this mesh (``models.state_shardings``; it may span
        several processes), each process reading only its devices' slices; None: whole
        tensors on the default device.
      rules: sharding rules (``models.sharding``), also set as the model config's
        ``sharding_rules``; None: the config's default.

    Returns:
      ``Transformer`` whose parameters are ``param_dtype`` arrays in their mesh layout (or
      on the default device).

    Raises:
      CheckpointError: unsupported architecture / setting, or a missing, extra or
        mis-shaped tensor (see ``load_params``).
      FileNotFoundError: no ``config.json``.
      ValueError: ``scan_layers`` with mixed dense / MoE layers; a parameter dimension not
        divisible by its mesh axes (named).
    """
    cfg = load_config(path, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers)
    if rules is not None:
        cfg = cfg.replace(sharding_rules=rules)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    shardings = None
    if mesh is not None:
        placed = state_shardings(nnx.state(model, nnx.Param), mesh, cfg.sharding_rules)
        shardings = {p: v.get_value() for p, v in nnx.to_flat_state(placed)}
    nnx.update(model, nnx.from_flat_state(list(load_params(path, cfg, shardings).items())))
    return model


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
    """
    tensors = _tensor_map(cfg)
    out = {}
    for p, var in nnx.to_flat_state(params):
        value = np.asarray(var[...])
        value = value if dtype is None else value.astype(dtype)
        out.update(zip(tensors[p].keys, tensors[p].to_hf(value)))
    return out


def _units(cfg: ModelConfig, path: tuple, shape: tuple[int, ...]) -> list[int | None]:
    """What ``save_params`` moves between processes at a time for parameter ``path``: one
    layer (index into the leading ``[L]`` axis) of a stacked parameter, else the whole
    parameter (None)."""
    return list(range(shape[0])) if cfg.scan_layers and path[0] == "layers" else [None]


def _gather(x: jax.Array, unit: int | None, dtype) -> np.ndarray:
    """``x[unit]`` (or all of ``x``) cast to ``dtype``, whole on this host. An array this
    process holds whole is read from its own shards; otherwise every process must call
    this (a collective): one jitted slice with a replicated output, the slice's
    all-reduce / all-gather moving only that slice (a static index: a traced one would
    gather the whole stacked array first)."""
    if x.is_fully_addressable or x.sharding.is_fully_replicated:
        value = x if x.is_fully_addressable else x.addressable_data(0)
        value = np.asarray(value if unit is None else value[unit])
        return value.astype(dtype)
    replicated = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    take = jax.jit(lambda a: (a if unit is None else a[unit]).astype(dtype),
                   out_shardings=replicated)
    return np.asarray(take(x).addressable_data(0))


def _barrier(name: str) -> None:
    """Every process waits here for the others (nothing when there is one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_params(params: dict[tuple, jax.Array], cfg: ModelConfig, path, *, dtype=None,
                max_shard_bytes: int = 5 * 2**30, metadata: dict | None = None,
                replace: bool = False,
                add_files: Callable[[Path], None] | None = None) -> list[Path]:
    """Write ``params`` as a HF checkpoint directory transformers (and vLLM) can load:
    ``config.json`` and ``model.safetensors``, or, above ``max_shard_bytes``,
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.

    The export owns ``path`` (``models.export_dir``): it is written into a staging
    directory beside it and moved into place when complete, replacing what was there
    whole, so no weight file or index of an earlier export survives (whatever its layout
    or dtype) and a failed export leaves the earlier one as it was. ``path`` must be
    missing, empty or a previous export unless ``replace`` is set; the check runs before
    anything is written.

    On several processes (a mesh spanning hosts) every process must call it with the
    same arguments: the shards are planned from the shapes alone, identically everywhere,
    and shard ``s`` is written by process ``s % jax.process_count()``. A parameter a
    process does not hold whole travels one unit at a time (one layer of a stacked
    ``[L, ...]`` parameter, else the whole parameter, e.g. the embedding): a jitted slice
    replicated to every device (the collective all processes join), kept by the process
    whose shard the unit's tensors fall in. So no host ever holds more than one unit plus
    the shard it is filling (<= ``max_shard_bytes``), never the whole model; the cost is
    network traffic: every unit reaches every host. Process 0 writes ``config.json`` and
    the index after a barrier, when every shard is on disk, then moves the directory into
    place (``path`` must be one directory every process sees, e.g. a shared file system);
    no process returns before it is there.

    Args:
      params: parameter path (as in ``nnx.to_flat_state``) -> array of the model of
        ``cfg``, in any sharding (e.g. the trainer's).
      cfg: the model's config.
      path: output directory.
      dtype: tensor dtype in the files, float32 or bfloat16 (``config.json``'s ``dtype``
        and ``torch_dtype``); default ``cfg.param_dtype``.
      max_shard_bytes: shard size limit (a tensor is never split).
      metadata: more ``config.json`` fields (e.g. ``bos_token_id`` / ``eos_token_id``),
        none of those the model's config determines.
      replace: replace ``path`` even if it is a file or a directory that holds no previous
        export (its contents are deleted once the new export is complete).
      add_files: called by process 0 with the staging directory once the weights and
        ``config.json`` are in it, before it is moved into place: the export's other files
        (e.g. the tokenizer's), which then appear together with the weights.

    Returns:
      The weight files this process wrote, at their final place under ``path``.

    Raises:
      CheckpointError: a config no HF architecture expresses (see ``architecture``).
      KeyError: ``params`` lacks a parameter of the model (its path named).
      ValueError: a ``dtype`` other than float32 / bfloat16; ``metadata`` setting a field
        the model's config determines (named).
      FileExistsError, ValueError: ``path`` may not be replaced (see
        ``models.export_dir.check_destination``).
    """
    dtype = jnp.dtype(cfg.param_dtype if dtype is None else dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"export dtype {dtype.name!r}: float32 or bfloat16 only")
    hf_config = config_to_hf(cfg, dtype.name)
    clash = sorted(set(metadata or {}) & set(hf_config))
    if clash:
        raise ValueError(f"metadata sets {clash}, which config.json takes from the model "
                         "and the export dtype")
    hf_config.update(metadata or {})
    path = Path(path).absolute()  # "." has a parent to stage beside
    tensors = _tensor_map(cfg)
    missing = sorted(set(tensors) - set(params), key=str)
    if missing:
        raise KeyError(f"no value for parameter {'/'.join(map(str, missing[0]))}")
    export_dir.check_destination(path, replace=replace)
    # the plan: (param path, unit, its HF keys and their bytes), then shards of whole tensors
    plan = []
    for p, t in tensors.items():
        shape = tuple(params[p].shape)
        units = _units(cfg, p, shape)
        per_unit = len(t.keys) // len(units)
        nbytes = math.prod(t.hf_shape(shape)) * dtype.itemsize
        for u, unit in enumerate(units):
            plan.append((p, unit, t.keys[u * per_unit:(u + 1) * per_unit], nbytes))
    shard_of, sizes = {}, [0]
    for _, _, keys, nbytes in plan:
        for key in keys:
            if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
                sizes.append(0)
            shard_of[key] = len(sizes) - 1
            sizes[-1] += nbytes
    n, me, count = len(sizes), jax.process_index(), jax.process_count()
    names = (["model.safetensors"] if n == 1 else
             [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)])
    left = [sum(1 for s in shard_of.values() if s == i) for i in range(n)]
    pending: dict[int, dict[str, np.ndarray]] = {}
    written = []
    if me == 0:
        export_dir.prepare(path)
    _barrier(f"save_params staging {path}")
    staging = export_dir.staging_dir(path)
    try:
        for p, unit, keys, _ in plan:
            if all(shard_of[k] % count != me for k in keys) and (
                    params[p].is_fully_addressable or params[p].sharding.is_fully_replicated):
                for key in keys:
                    left[shard_of[key]] -= 1
                continue  # not this process's, and no collective to join
            t = tensors[p]
            value = _gather(params[p], unit, dtype)
            lead = t.lead - (unit is not None)
            parts = _Tensor(keys, t.n_in, lead, t.flat).to_hf(value)
            for key, part in zip(keys, parts, strict=True):
                shard = shard_of[key]
                left[shard] -= 1
                if shard % count == me:
                    pending.setdefault(shard, {})[key] = part
                if not left[shard] and shard in pending:
                    save_file(pending.pop(shard), staging / names[shard],
                              metadata=export_dir.MARK)
                    written.append(path / names[shard])
        _barrier(f"save_params {path}")
        if me == 0:
            if n > 1:
                index = {"metadata": {"total_size": sum(sizes)},
                         "weight_map": {k: names[s] for k, s in shard_of.items()}}
                (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
            if add_files is not None:
                add_files(staging)
            export_dir.commit(path)
    except BaseException:
        if count == 1:  # on several, the next export to path removes the staging directory
            export_dir.discard(path)
        raise
    _barrier(f"save_params done {path}")
    return written


def save_model(model: Transformer, path, *, dtype=None, max_shard_bytes: int = 5 * 2**30,
               metadata: dict | None = None, replace: bool = False) -> list[Path]:
    """Export ``model`` as a HF checkpoint directory transformers can load
    (``save_params`` of its parameters; every process calls it when they span several).

    Args:
      model: the ``Transformer``.
      path, dtype, max_shard_bytes, metadata, replace: see ``save_params``.

    Returns:
      The safetensors files this process wrote.

    Raises:
      CheckpointError, ValueError, FileExistsError: see ``save_params``.
    """
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return save_params({p: v[...] for p, v in params.items()}, model.cfg, path, dtype=dtype,
                       max_shard_bytes=max_shard_bytes, metadata=metadata, replace=replace)
