"""Padding invariance of the GRPO step: padding rows, or padding tokens at the end of rows,
change no real token's log-prob, entropy, loss or gradient. ``invariance`` runs in the
test process (one device, ``tests/models/test_padding_invariance.py``); ``ragged_case``
and ``dense_case`` run it on 8 CPU devices in a subprocess (``tests.support.multidevice``),
where the MoE is expert-parallel; ``layer_case`` checks each dispatch path of the experts
alone."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import jaxhead
from harness.oracle import max_abs
from models import get_config
from models.mesh import make_mesh
from tests.support.models import random_model
from train.rl import packing, rl_loss, state, steps
from train.rl.placement import Placement, place_batch

#: The GRPO loss of the check: every term that reads the log-probs, the entropy or the
#: router (clipped surrogate, k3 KL to a reference, entropy bonus, the MoE aux loss).
LOSS = rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3",
                          entropy_coef=0.01, aggregation="seq-mean-token-mean",
                          max_completion_len=12)
#: Padding values of each per-token array (``train.rl.packing``: token 0, segment 0, ...).
FILL = {"labels": -100, "seq_index": -1}


def packed_batch(rows: int = 8, row_len: int = 16, seed: int = 0):
    """A packed batch of ``rows`` rows (several sequences per row, tail padding), with
    sampler log-probs, advantages and reference log-probs on the completion tokens."""
    rng = np.random.default_rng(seed)
    prompts, comps = [], []
    while sum(len(p) + len(c) for p, c in zip(prompts, comps, strict=True)) < rows * row_len * 0.7:
        n = int(rng.integers(3, row_len + 1))
        cut = int(rng.integers(1, n))
        prompts.append(rng.integers(1, 500, cut).tolist())
        comps.append(rng.integers(1, 500, n - cut).tolist())
    adv = rng.standard_normal(len(comps)).astype(np.float32)
    packed = packing.pack(prompts, comps, row_len, num_rows=rows, values={
        "old_logp": [rng.uniform(-7.0, -5.0, len(c)) for c in comps],
        "advantages": [np.full(len(c), a, np.float32) for c, a in zip(comps, adv, strict=True)],
        "ref_logp": [rng.uniform(-7.0, -5.0, len(c)) for c in comps]})
    return packed.arrays("old_logp", "advantages", "ref_logp"), packed.num_seqs


def pad(arrays: dict, rows: int = 0, tokens: int = 0) -> dict:
    """``arrays`` with ``rows`` padding rows below and ``tokens`` padding tokens at the end
    of every row (the values packing gives padding)."""
    return {k: np.pad(v, ((0, rows), (0, tokens)), constant_values=FILL.get(k, 0))
            for k, v in arrays.items()}


def variants(arrays: dict) -> dict:
    """The batch, with as many padding rows again, and with every row twice as long."""
    r, t = arrays["tokens"].shape
    return {"base": arrays, "rows": pad(arrays, rows=r), "tokens": pad(arrays, tokens=t)}


def step_outputs(mdef, params, arrays, num_seqs, bucket, placement=None) -> dict:
    """Loss, gradients, the ``[R, L]`` log-probs and entropy and, for an MoE model, the
    dropped fraction (``"dropped"``, a metric of the step) of the trainer's GRPO step
    (``train.rl.steps.grpo_loss_fn``) on ``arrays``: plain ``jax.jit`` on one device, or
    compiled by ``placement`` on its mesh with the parameters in its shardings."""
    loss_fn = steps.grpo_loss_fn(mdef, LOSS, 1.0, skip=True)

    def run(params, b):
        (loss, (metrics, logp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, b, b["ref_logp"], num_seqs, bucket)
        keep = b["loss_mask"] > 0
        head, _ = mdef.merge(params).token_logprobs(
            b["tokens"], b["positions"], b["segment_ids"], b["labels"], keep, bucket=bucket)
        out = {"loss": loss, "grads": grads, "logp": logp, "entropy": head.entropy}
        if "moe_dropped_fraction" in metrics:
            out["dropped"] = metrics["moe_dropped_fraction"]
        return out

    if placement is None:
        out = jax.jit(run)(jax.tree.map(jnp.asarray, params), place_batch(arrays))
    else:
        out = placement.jit(run)(placement.place_params(params),
                                 place_batch(arrays, placement.mesh))
    return jax.device_get(out)


def scaled_error(a, b) -> float:
    """``max |a - b| / max(1, max |b|)``: absolute below 1, relative above (a float32
    log-prob near -6 has an ulp of 4.8e-7)."""
    return max_abs(a, b) / max(1.0, float(np.max(np.abs(np.asarray(b, np.float64)))))


def invariance(preset: str, mesh: dict | None = None, **overrides) -> dict:
    """``scaled_error`` of each output on the real tokens between the padded batches and
    the base one (every gradient tensor: the largest), for the random ``preset`` model
    (float32) on one device or on ``mesh``; the dropped fraction of each batch and the
    largest |log-prob| at a padding position."""
    cfg = get_config(preset, dtype="float32", **overrides)
    model = random_model(cfg, seed=3)
    mdef, params = state.ModelDef.of(cfg), jax.device_get(state.params_of(model))
    placement = None if mesh is None else Placement(make_mesh(mesh), mdef)
    arrays, num_seqs = packed_batch()
    real = arrays["loss_mask"] > 0
    shards = 1 if placement is None else placement.batch_shards
    outs = {name: step_outputs(mdef, params, a, num_seqs, jaxhead.bucket_for_shards(
                a["loss_mask"] > 0, shards, multiple=16), placement)
            for name, a in variants(arrays).items()}
    base = outs["base"]

    def on_real(x):
        return np.asarray(x)[: real.shape[0], : real.shape[1]][real]

    result = {"dropped": {k: float(o["dropped"]) for k, o in outs.items()},
              "kept": int(real.sum()), "loss": float(base["loss"])}
    for name in ("rows", "tokens"):
        o = outs[name]
        result[name] = {
            "logp": scaled_error(on_real(o["logp"]), on_real(base["logp"])),
            "entropy": scaled_error(on_real(o["entropy"]), on_real(base["entropy"])),
            "loss": scaled_error(o["loss"], base["loss"]),
            "grads": max(scaled_error(o["grads"][k], base["grads"][k]) for k in base["grads"]),
            "padding_logp": float(np.abs(np.asarray(o["logp"])[
                np.asarray(variants(arrays)[name]["loss_mask"]) == 0]).max()),
        }
    return result


MESH = {"data": 2, "expert": 4}
#: ``tiny`` (tied embeddings) with layer 0 dense and layer 1 MoE: both kinds in one model.
MIXED = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
         "mlp_only_layers": (0,)}


def ragged_case() -> dict:
    """``invariance`` of the ``MIXED`` model on data=2 x expert=4, ragged dispatch with a
    capacity factor the real tokens fit (1.25; the padded batches have more tokens per
    device, so more receive rows, than the base one; padding that took capacity would
    overflow it)."""
    return invariance("tiny", MESH, expert_dispatch="ragged", expert_capacity_factor=1.25,
                      **MIXED)


def dense_case() -> dict:
    """``invariance`` of the tiny MoE on data=2 x expert=4, dense (worst-case) dispatch."""
    return invariance("tiny-moe", MESH, expert_dispatch="dense")


def layer_case() -> dict:
    """The MoE experts with a quarter of the tokens padding (interleaved, random hidden
    states, all routed to experts 0 and 1, non-zero cotangents) on each dispatch path
    (one device; data=2 x expert=4 dense; ragged with a capacity factor the real tokens
    fit) vs one device on the real tokens alone: outputs and gradients on the real
    tokens, and what padding gets (output, gradient of its hidden state and weights)."""
    from models.moe.api import routed_experts
    from models.moe.reference import dropless_experts

    rng = np.random.default_rng(5)
    tokens, h, i, e, k = 128, 16, 8, 8, 2
    valid = rng.permutation(tokens) >= tokens // 4
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    logits = jax.nn.softmax(jnp.asarray(rng.standard_normal((tokens, e)), jnp.float32))
    weights, experts = jax.lax.top_k(logits, k)
    experts = jnp.where(jnp.asarray(valid)[:, None], experts, jnp.array([0, 1]))
    params = tuple(jnp.asarray(rng.standard_normal(s) / 4, jnp.float32)
                   for s in ((e, h, i), (e, h, i), (e, i, h)))
    cotangent = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    mask = jnp.asarray(valid)

    def vjp(layer, x, experts, weights, cotangent):
        y, pull, dropped = jax.vjp(lambda x, w, *p: layer(x, experts, w, *p), x, weights,
                                   *params, has_aux=True)
        return y, pull(cotangent), dropped

    def one_device(*args, token_mask=None):
        return dropless_experts(*args, token_mask=token_mask), jnp.zeros(())

    ref_y, ref_g, _ = jax.jit(lambda: vjp(one_device, x[mask], experts[mask],
                                          weights[mask], cotangent[mask]))()
    mesh = make_mesh({"data": 2, "expert": 4})
    paths = {"one_device": partial(one_device, token_mask=mask),
             "dense": partial(routed_experts, mesh=mesh, token_mask=mask,
                              dispatch="dense"),
             "ragged_factor": partial(routed_experts, mesh=mesh,
                                      token_mask=mask, dispatch="ragged",
                                      capacity_factor=1.5)}
    out = {}
    for name, layer in paths.items():
        with jax.set_mesh(mesh):
            y, (gx, gw, *gp), dropped = jax.jit(
                lambda layer=layer: vjp(layer, x, experts, weights, cotangent))()
        out[name] = {
            "value": max_abs(y[mask], ref_y), "x_grad": max_abs(gx[mask], ref_g[0]),
            "weight_grad": max_abs(gw[mask], ref_g[1]),
            "param_grads": max(max_abs(a, b) for a, b in zip(gp, ref_g[2:], strict=True)),
            "padding_out": float(jnp.abs(y[~mask]).max()),
            "padding_x_grad": float(jnp.abs(gx[~mask]).max()),
            "padding_weight_grad": float(jnp.abs(gw[~mask]).max()),
            "dropped": int(jnp.sum(dropped)),
        }
    return out
