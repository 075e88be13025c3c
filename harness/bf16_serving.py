"""What an exported policy computes where transformers serves it, against the trainer's own
forward passes (``benchmarks/bf16_serving.py`` prints it for docs/export.md;
``tests/models/test_bf16_serving.py`` checks it at tiny size).

The one rounding that differs by construction is RMSNorm's in bfloat16: ours
(``models.layers.RMSNorm``) multiplies the float32 normalised input by the scale in float32
and rounds once, transformers' ``*RMSNorm`` rounds the normalised input to bfloat16 first,
then multiplies by the bfloat16 weight in bfloat16 (a second rounding).

Needs torch and transformers (imported when called).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import ModelConfig, load_model, save_model
from models.hf import config_to_hf
from models.layers import RMSNorm


def norm_outputs_bit_equal(dim: int = 1024, rows: int = 256, seed: int = 0) -> float:
    """The fraction of bfloat16 RMSNorm outputs that are bit-equal between ours and
    transformers' (``Qwen3RMSNorm``), for the same bfloat16 inputs (``N(0, 1)``, ``[rows,
    dim]``) and bfloat16 scales (``1 + 0.2 N(0, 1)``, a bf16 export's weights), eps 1e-6.
    """
    import torch
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, dim)), jnp.bfloat16)
    scale = jnp.asarray(1.0 + 0.2 * rng.standard_normal(dim), jnp.bfloat16)
    ours = RMSNorm(dim, "embed", eps=1e-6, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                   rngs=nnx.Rngs(0))
    ours.scale[...] = scale.astype(jnp.float32)
    mine = np.asarray(ours(x).astype(jnp.float32))
    theirs_norm = Qwen3RMSNorm(dim, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        theirs_norm.weight.copy_(torch.tensor(np.asarray(scale.astype(jnp.float32))))
        theirs = theirs_norm(torch.tensor(np.asarray(x.astype(jnp.float32))).bfloat16())
    return float(np.mean(mine == theirs.float().numpy()))


def random_checkpoint(cfg: ModelConfig, path, seed: int = 0):
    """A random float32 transformers model of ``cfg``'s architecture saved to ``path``:
    norm weights ``1 + 0.2 N(0, 1)``, every matrix ``N(0, 1 / fan_in)`` (the embedding
    ``N(0, 1 / hidden)``: logits of a tied head spread over a few nats). Returns it."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(**config_to_hf(cfg, "float32"))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(path)
    return model


def _next_token_logprobs(logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """``log p(tokens[:, t + 1])`` from float32 ``logits[:, t]``, ``[B, S - 1]``."""
    logits = logits[:, :-1].astype(np.float64)
    top = logits.max(-1, keepdims=True)
    logz = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    return np.take_along_axis(logits, tokens[:, 1:, None], -1)[..., 0] - logz


def logprob_gaps(cfg: ModelConfig, tokens: np.ndarray, seed: int = 0) -> dict[str, float]:
    """Mean ``|log p_a(y) - log p_b(y)|`` over the next tokens ``y`` of ``tokens`` (nats per
    token) for a random model of ``cfg`` (``random_checkpoint``), between:

    - ``"served_bf16"``: transformers on its bfloat16 export vs our bfloat16 forward (the
      trainer's: bfloat16 compute, float32 parameters);
    - ``"ours_bf16_vs_f32"``: our bfloat16 forward vs our float32 forward;
    - ``"served_f32"``: transformers on its float32 export vs our float32 forward.

    Args:
      cfg: the architecture (its ``dtype`` / ``param_dtype`` are ignored).
      tokens: int ``[B, S]`` token ids.
    """
    import torch
    import transformers

    logps = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        random_checkpoint(cfg, tmp / "base", seed)
        for dtype in ("float32", "bfloat16"):
            model = load_model(tmp / "base", dtype=dtype, param_dtype="float32")
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            out = model(jnp.asarray(tokens), positions, jnp.ones(tokens.shape, jnp.int32))
            logps[f"ours_{dtype}"] = _next_token_logprobs(
                np.asarray(model.logits(out.hidden), np.float32), tokens)
            save_model(model, tmp / dtype, dtype=dtype)
            served = transformers.AutoModelForCausalLM.from_pretrained(
                tmp / dtype, dtype=getattr(torch, dtype)).eval()
            with torch.no_grad():
                logits = served(torch.as_tensor(tokens, dtype=torch.long)).logits
            logps[f"served_{dtype}"] = _next_token_logprobs(logits.float().numpy(), tokens)
            del model, served

    def gap(a, b):
        return float(np.mean(np.abs(logps[a] - logps[b])))

    return {"served_bf16": gap("served_bfloat16", "ours_bfloat16"),
            "ours_bf16_vs_f32": gap("ours_bfloat16", "ours_float32"),
            "served_f32": gap("served_float32", "ours_float32")}
