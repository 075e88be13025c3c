"""Qwen3-MoE (``Qwen3MoeForCausalLM``, ``model_type`` ``qwen3_moe``): Qwen3's attention with
sparse MoE blocks (``decoder_sparse_step``, ``mlp_only_layers`` choose which layers), their
experts stored one key per expert or fused as transformers 5 holds them."""

from __future__ import annotations

from models.config import ModelConfig
from models.hf.family import (
    Family,
    FusedLayout,
    LayerTensors,
    attention,
    experts,
    mlp,
    norms,
    qk_norms,
)


def sparse_mlp(cfg: ModelConfig, i: int) -> LayerTensors:
    """Layer ``i``'s experts and router if it is sparse (``cfg.is_moe_layer(i)``), else
    its dense MLP."""
    return experts(cfg, i) if cfg.is_moe_layer(i) else mlp(cfg, i)


def read_config(hf: dict) -> dict:
    """The MoE's ``ModelConfig`` fields (``num_experts``, or Mixtral's name for it,
    ``num_local_experts``)."""
    return {
        "num_experts": hf.get("num_experts", hf.get("num_local_experts")),
        "num_experts_per_tok": hf["num_experts_per_tok"],
        "moe_intermediate_size": hf["moe_intermediate_size"],
        "norm_topk_prob": hf.get("norm_topk_prob", False),
        "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
        "mlp_only_layers": tuple(hf.get("mlp_only_layers") or ()),
        "router_aux_loss_coef": hf.get("router_aux_loss_coef", 0.001),
    }


def write_config(cfg: ModelConfig) -> dict:
    """No attention bias, and the MoE's fields."""
    return {
        "attention_bias": False,
        "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
    }


def fused_experts(cfg: ModelConfig) -> FusedLayout:
    """transformers 5's ``Qwen3MoeExperts``: ``gate_up_proj`` ``[E, 2I, H]`` (each expert's
    gate rows, then its up rows) and ``down_proj`` ``[E, H, I]``."""
    e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    return {"gate_up_proj": ((e, 2 * i, h), (("gate_proj", 0), ("up_proj", i))),
            "down_proj": ((e, h, i), (("down_proj", 0),))}


FAMILY = Family(
    architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe",
    fixed={"qk_norm": True, "qkv_bias": False},
    layer=(norms, attention, qk_norms, sparse_mlp), moe=True,
    read_config=read_config, write_config=write_config, fused_experts=fused_experts,
)
