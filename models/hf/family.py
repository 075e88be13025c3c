"""The record of one Hugging Face model family (``Family``) and what the families share.

A family is one ``architectures[0]`` of ``config.json`` (``Qwen3ForCausalLM``,
``LlamaForCausalLM``, ...). Its record holds everything that differs from one family to the
next: how its ``config.json`` maps onto ``ModelConfig`` (the fields the family fixes, the
ones it reads, the settings it refuses), the tensors of a decoder layer with their names
and layouts (``models.hf.layout.Tensor``), how transformers 5 fuses its experts, and the
fields its export writes. The shape is that of MaxText's checkpoint-conversion mappers
(per model a parameter-name mapping, the layout hooks that reshape each tensor, and the HF
config; ``MaxText/utils/ckpt_conversion/utils/param_mapping.py`` and
``hf_model_configs.py``), gathered into one record per family.

What every family here shares is stated once, below: the embedding, final norm and LM head
(``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``; a tied
checkpoint may omit the head), the layer pieces a family's ``layer`` is assembled from
(``norms``, ``attention``, ``qk_norms``, ``qkv_biases``, ``mlp``, ``experts``), the
RoPE settings (``rope_from_hf``), and the fields of ``config.json`` every family maps the
same way (``models.hf.mapping``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from models.config import LLAMA3_ROPE_KEYS, ModelConfig
from models.hf.layout import Tensor

#: The tensors outside the decoder layers, the same in every family.
EMBEDDING = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
#: Boolean ``config.json`` settings the decoder does not implement; a family whose
#: transformers class hard-codes one of them (Qwen2's q/k/v biases) leaves it out.
REFUSED = ("attention_bias", "mlp_bias", "use_sliding_window")

#: A layer's tensors: our parameter path within the layer -> its HF storage.
LayerTensors = dict[tuple, Tensor]
#: transformers 5's fused experts of one MoE layer: the fused tensor's name under
#: ``model.layers.{i}.mlp.experts`` -> (its shape ``[E, rows, cols]``, and the
#: per-expert projections it holds as ``(name, first row)``, in row order).
FusedLayout = dict[str, tuple[tuple[int, ...], tuple[tuple[str, int], ...]]]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: unsupported architecture or feature, missing,
    unexpected or mis-shaped tensor (the message names the key and both shapes)."""


def _nothing(_) -> dict:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face model family, as ``models.hf`` reads and writes it.

    Attributes:
      architecture: ``architectures[0]`` of its ``config.json``, e.g.
        ``"LlamaForCausalLM"``.
      model_type: its ``model_type``, e.g. ``"llama"`` (a checkpoint must name both).
      fixed: the ``ModelConfig`` fields the family fixes (e.g. ``{"qk_norm": True,
        "qkv_bias": False}``): set on import; on export a config is this family's when
        it has these values and experts exactly when ``moe``.
      layer: the pieces of a decoder layer, in the order of its keys: each
        ``piece(cfg, i)`` -> tensors of layer ``i`` (our path within the layer ->
        ``Tensor``); the shared pieces are below (``norms``, ``attention``, ...).
      moe: whether its configs have experts (``num_experts > 0``).
      refused: the boolean ``config.json`` settings it refuses when true (named in the
        ``CheckpointError``).
      read_config: ``config.json`` dict -> more ``ModelConfig`` fields (e.g. the MoE's).
      write_config: ``ModelConfig`` -> more ``config.json`` fields of an export, after the
        shared ones.
      fused_experts: ``cfg`` -> the ``FusedLayout`` transformers 5 uses for its experts,
        which the import reads as well as the per-expert keys; None: no fused layout.
    """

    architecture: str
    model_type: str
    fixed: Mapping[str, Any]
    layer: tuple[Callable[[ModelConfig, int], LayerTensors], ...]
    moe: bool = False
    refused: tuple[str, ...] = REFUSED
    read_config: Callable[[dict], dict] = _nothing
    write_config: Callable[[ModelConfig], dict] = _nothing
    fused_experts: Callable[[ModelConfig], FusedLayout] | None = None

    def __post_init__(self):
        """Raises ValueError: a ``fixed`` field ``ModelConfig`` lacks, or a ``layer`` that
        is not a tuple of pieces (each named)."""
        unknown = sorted(set(self.fixed) - {f.name for f in dataclasses.fields(ModelConfig)})
        if unknown:
            raise ValueError(f"family {self.architecture}: fixed fields {unknown} are not "
                             "ModelConfig fields")
        if not isinstance(self.layer, tuple) or not all(map(callable, self.layer)):
            raise ValueError(f"family {self.architecture}: layer must be a tuple of pieces "
                             f"piece(cfg, i), got {self.layer!r}")

    def expresses(self, cfg: ModelConfig) -> bool:
        """Whether ``cfg`` is a model of this family (the ``fixed`` fields, experts)."""
        return (bool(cfg.num_experts) == self.moe
                and all(getattr(cfg, k) == v for k, v in self.fixed.items()))

    def layer_tensors(self, cfg: ModelConfig, i: int) -> LayerTensors:
        """The tensors of decoder layer ``i``: those of each piece of ``layer``."""
        return {path: t for piece in self.layer for path, t in piece(cfg, i).items()}


def rope_from_hf(hf: dict, arch: str) -> tuple[float, tuple | None]:
    """``(rope_theta, rope_scaling)`` of a ``config.json``: ``rope_parameters``
    (transformers >= 5) or the older ``rope_scaling`` + top-level ``rope_theta``.

    Raises:
      CheckpointError: a RoPE type other than default or ``"llama3"`` (the scaling of
        Llama 3.1, transformers' ``_compute_llama3_parameters``), or a ``"llama3"``
        scaling without one of its keys (named).
    """
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


# The layer pieces: ``piece(cfg, i)`` -> our path within layer ``i`` -> its storage (a
# kernel's ``n_in``: how many of our leading axes are inputs).

def _prefix(i: int) -> str:
    return f"model.layers.{i}."


def norms(cfg: ModelConfig, i: int) -> LayerTensors:
    """The RMS norms before attention and before the MLP: scales ``[H]``."""
    pre = _prefix(i)
    return {(norm, "scale"): Tensor((f"{pre}{norm}.weight",))
            for norm in ("input_layernorm", "post_attention_layernorm")}


def attention(cfg: ModelConfig, i: int) -> LayerTensors:
    """The q/k/v/o projections: ours ``[H, N, D]`` / ``[N, D, H]``, files ``[out, in]``."""
    pre = _prefix(i)
    return {("self_attn", proj): Tensor((f"{pre}self_attn.{proj}.weight",),
                                        n_in=2 if proj == "o_proj" else 1)
            for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}


def qk_norms(cfg: ModelConfig, i: int) -> LayerTensors:
    """The per-head RMS norms of queries and keys (Qwen3): scales ``[D]``."""
    pre = _prefix(i)
    return {("self_attn", norm, "scale"): Tensor((f"{pre}self_attn.{norm}.weight",))
            for norm in ("q_norm", "k_norm")}


def qkv_biases(cfg: ModelConfig, i: int) -> LayerTensors:
    """The q/k/v biases (Qwen2): ours ``[N, D]`` / ``[K, D]``, files flat ``[N*D]``."""
    pre = _prefix(i)
    return {("self_attn", f"{proj}_bias"): Tensor((f"{pre}self_attn.{proj}_proj.bias",),
                                                  flat=True)
            for proj in ("q", "k", "v")}


def mlp(cfg: ModelConfig, i: int) -> LayerTensors:
    """The dense SwiGLU MLP: gate / up ``[H, I]`` and down ``[I, H]`` (files transposed)."""
    pre = _prefix(i)
    return {("mlp", proj): Tensor((f"{pre}mlp.{proj}.weight",), n_in=1)
            for proj in ("gate_proj", "up_proj", "down_proj")}


def experts(cfg: ModelConfig, i: int) -> LayerTensors:
    """A sparse MoE block: each projection's ``cfg.num_experts`` experts stacked on our
    leading ``[E]`` axis, one key per expert in the files
    (``mlp.experts.{e}.gate_proj.weight``), then the router ``mlp.gate.weight`` (ours
    ``[H, E]``)."""
    pre = _prefix(i)
    out = {("mlp", proj): Tensor(tuple(f"{pre}mlp.experts.{e}.{proj}.weight"
                                       for e in range(cfg.num_experts)), n_in=1, lead=1)
           for proj in ("gate_proj", "up_proj", "down_proj")}
    out[("mlp", "router")] = Tensor((f"{pre}mlp.gate.weight",), n_in=1)
    return out
