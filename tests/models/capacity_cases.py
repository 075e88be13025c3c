"""Multi-device cases of the MoE capacity (``models.moe.ragged``), run in a subprocess
with 8 CPU devices by ``tests/models/test_moe_capacity.py``: padding takes no capacity,
real pairs past it are dropped by GShard's priority (checked against a float64 reference
of the rule), strict mode turns them into NaN, and the model reports the dropped
fraction."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxhead
from harness.oracle import max_abs
from models import get_config
from models.moe.api import routed_experts
from models.moe.layer import route
from models.moe.ragged import receive_rows
from tests.models.sharding_cases import compare_on_mesh
from tests.support.models import random_model

TOKENS, HIDDEN, MLP, EXPERTS, TOP_K = 128, 16, 8, 8, 2
#: 16 tokens per device, in rounds of 8 (``max_rows=16`` rows: ``receive_rows(8, ...)``).
ROUND, MAX_ROWS, FACTOR = 8, 16, 1.0


def gshard_dropped(experts, valid, *, data, num, local, round_tokens, rows):
    """The pairs the capacity rule drops, pair by pair (float-free reference).

    The tokens are split into ``data * num`` equal device shards (shard ``d * num + s``:
    data index ``d``, expert-axis index ``s``), each cut into rounds of ``round_tokens``.
    Per (data index, round) and destination device (``expert // local``), the real pairs
    are taken in GShard's order (Lepikhin et al. 2020, Algorithm 1: every token's first
    choice, then every second choice, ...; within a choice rank by source device, local
    expert and token) and the first ``rows`` kept. With ``local == 1`` this is GShard's
    rule exactly (one expert per device, capacity ``rows`` per expert).

    Args:
      experts: int ``[T, k]``; valid: bool ``[T]`` (False: padding, never counted).

    Returns:
      bool ``[T, k]``.
    """
    total, top_k = experts.shape
    per_shard = total // (data * num)
    dropped = np.zeros((total, top_k), bool)
    for d in range(data):
        for r in range(per_shard // round_tokens):
            used = np.zeros(num, int)
            for j in range(top_k):
                for s in range(num):
                    start = (d * num + s) * per_shard + r * round_tokens
                    for e in range(num * local):
                        for t in range(start, start + round_tokens):
                            if valid[t] and experts[t, j] == e:
                                if used[e // local] < rows:
                                    used[e // local] += 1
                                else:
                                    dropped[t, j] = True
    return dropped


def _reference_layer(x, weights, gate, up, down, experts, keep):
    """float64 ``sum_j keep * w * expert(x)`` by a loop over the experts."""
    out = jnp.zeros_like(x)
    for e in range(gate.shape[0]):
        y = (jax.nn.silu(x @ gate[e]) * (x @ up[e])) @ down[e]
        w = jnp.sum(jnp.where(keep & (experts == e), weights, 0.0), axis=1)
        out = out + w[:, None] * y
    return out


def _overflow_inputs():
    """Random rows routed with a skew towards experts 0 and 1; a quarter of the tokens
    are padding, and every padding token picks the hot experts (as identical padding
    hidden states do), which must cost no capacity."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((TOKENS, HIDDEN))
    logits = rng.standard_normal((TOKENS, EXPERTS))
    logits[:, 0] += 1.5
    logits[:, 1] += 1.0
    valid = rng.random(TOKENS) >= 0.25
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    experts = np.argsort(-probs, axis=1)[:, :TOP_K].astype(np.int32)
    experts[~valid] = [0, 1]
    weights = np.take_along_axis(probs, experts, axis=1)
    params = tuple(rng.standard_normal(s) / 4 for s in
                   ((EXPERTS, HIDDEN, MLP), (EXPERTS, HIDDEN, MLP), (EXPERTS, MLP, HIDDEN)))
    cotangent = rng.standard_normal((TOKENS, HIDDEN))
    return x, experts, weights, valid, params, cotangent


def _run(mesh_shape, overflow, x, experts, weights, valid, params, cotangent):
    """``routed_experts`` (ragged, ``FACTOR``, rounds of ``ROUND`` tokens) on a mesh:
    ``(y, dropped)``, and with ``overflow="drop"`` the gradients of ``(x, weights, gate,
    up, down)`` for ``cotangent``."""
    from models.mesh import make_mesh

    mesh = make_mesh(mesh_shape)
    f32 = [jnp.asarray(a, jnp.float32) for a in (x, weights, *params)]

    def layer(x, weights, *p):
        return routed_experts(
            x, jnp.asarray(experts), weights, *p, mesh=mesh, dispatch="ragged",
            capacity_factor=FACTOR, overflow=overflow, max_rows=MAX_ROWS,
            token_mask=jnp.asarray(valid))

    def run():
        if overflow == "nan":
            return layer(*f32)
        y, pull, dropped = jax.vjp(layer, *f32, has_aux=True)
        return y, dropped, pull(jnp.asarray(cotangent, jnp.float32))

    with jax.set_mesh(mesh):
        return jax.jit(run)()


def _versus_reference(shape, inputs):
    """``_run`` (drop) on the mesh ``shape`` against ``gshard_dropped`` and the float64
    layer without the dropped pairs: ``(measurements, y, reference dropped pairs)``."""
    x, experts, weights, valid, params, cotangent = inputs
    num = shape["expert"]
    local = EXPERTS // num
    rows = receive_rows(ROUND, num, TOP_K, local, FACTOR)
    ref_dropped = gshard_dropped(experts, valid, data=shape.get("data", 1), num=num,
                                 local=local, round_tokens=ROUND, rows=rows)
    y, dropped, grads = _run(shape, "drop", *inputs)
    y, dropped = np.asarray(y), np.asarray(dropped)
    keep = jnp.asarray(valid[:, None] & ~ref_dropped)
    with jax.enable_x64(True):
        @jax.jit
        def reference(*args):
            y, pull = jax.vjp(lambda *a: _reference_layer(*a, jnp.asarray(experts), keep),
                              *args)
            return y, pull(jnp.asarray(cotangent, jnp.float64))

        y64, g64 = reference(*(jnp.asarray(a, jnp.float64) for a in (x, weights, *params)))
    one_dropped = ref_dropped.sum(axis=1) == 1
    pairs = int(valid.sum()) * TOP_K
    return {
        "rows": rows, "pairs": pairs, "ref_dropped": int(ref_dropped.sum()),
        "ref_dropped_first_choices": int(ref_dropped[:, 0].sum()),
        "mismatched_pairs": int((dropped != ref_dropped).sum()),
        "fraction": float(dropped.sum() / pairs), "ref_fraction": float(ref_dropped.sum() / pairs),
        "value": max_abs(y, y64),
        "grads": {k: max_abs(a, b) for k, a, b in
                  zip(("x", "weights", "gate", "up", "down"), grads, g64, strict=True)},
        "tokens_with_one_drop": int(one_dropped.sum()),
        "min_norm_with_one_drop": float(np.linalg.norm(y[one_dropped], axis=1).min()),
        "padding_max_abs": float(np.abs(y[~valid]).max()),
    }, y, ref_dropped


def dropping_case() -> dict:
    """A round that overflows, on expert=8 (one expert per device: GShard's rule exactly)
    and data=2 x expert=4 (2 per device): the dropped pairs against ``gshard_dropped``,
    outputs and gradients against a float64 reference in which the dropped pairs add
    nothing; strict mode's NaN rows (data=2 x expert=4)."""
    inputs = _overflow_inputs()
    out = {"expert8": _versus_reference({"expert": 8}, inputs)[0]}
    shape = {"data": 2, "expert": 4}
    out["data2_expert4"], y, ref_dropped = _versus_reference(shape, inputs)
    y_nan, dropped_nan = _run(shape, "nan", *inputs)
    nan_rows = np.isnan(np.asarray(y_nan)).any(axis=1)
    out["strict"] = {
        "nan_rows_match": bool(np.array_equal(nan_rows, ref_dropped.any(axis=1))),
        "nan_rows": int(nan_rows.sum()),
        "rest_equal": max_abs(np.asarray(y_nan)[~nan_rows], y[~nan_rows]),
        "dropped_match": bool(np.array_equal(np.asarray(dropped_nan), ref_dropped)),
    }
    return out


def _reported_batch():
    """The reported layout: 32 rows of 16 tokens, 8 of them one real sequence each, then
    24 padding rows (75% padding, as packing leaves it); every kept label scored."""
    rng = np.random.default_rng(0)
    seg = np.zeros((32, 16), np.int32)
    seg[:8] = 1
    tokens = np.where(seg > 0, rng.integers(0, 512, seg.shape), 0).astype(np.int32)
    positions = np.where(seg > 0, np.arange(16)[None], 0).astype(np.int32)
    labels, valid = jaxhead.next_token_labels(jnp.asarray(tokens), jnp.asarray(seg))
    return {"tokens": tokens, "positions": positions, "segment_ids": seg,
            "labels": np.asarray(labels).astype(np.int32), "keep": np.asarray(valid)}


def reported_case() -> dict:
    """The reported failure: tiny-moe, ragged dispatch, data=2 x expert=4, 75% padding,
    ``expert_capacity_factor=1.25``: its kept log-probs vs the dropless (one-device) run."""
    batch = _reported_batch()
    cfg = get_config("tiny-moe", dtype="float32", expert_dispatch="ragged",
                     expert_capacity_factor=1.25)
    graphdef, state = nnx.split(random_model(cfg, seed=3))

    def logprobs(state, b):
        head, _ = nnx.merge(graphdef, state).token_logprobs(
            b["tokens"], b["positions"], b["segment_ids"], b["labels"], b["keep"], bucket=128)
        return head.logprobs

    _, ref, out, *_ = compare_on_mesh(logprobs, state, batch, {"data": 2, "expert": 4})
    keep = batch["keep"]
    out, ref = np.asarray(out)[keep], np.asarray(ref)[keep]
    return {"kept": int(keep.sum()), "nan": int(np.isnan(out).sum()),
            "max_abs": float(np.nanmax(np.abs(out - ref)))}


def metric_case() -> dict:
    """``DecoderOutput.dropped_fraction`` of a one-layer tiny-moe on data=2 x expert=4 with
    a capacity factor of 0.5 (half the balanced load: real pairs must overflow) on the
    reported batch, vs ``gshard_dropped`` of the layer's routing (computed on one
    device from the MoE's input); one device (no capacity) drops nothing."""
    batch = _reported_batch()
    cfg = get_config("tiny-moe", dtype="float32", num_hidden_layers=1,
                     expert_dispatch="ragged", expert_capacity_factor=0.5)
    model = random_model(cfg, seed=5)
    graphdef, state = nnx.split(model)

    def fraction(state, b):
        out = nnx.merge(graphdef, state)(b["tokens"], b["positions"], b["segment_ids"])
        return out.dropped_fraction

    _, one_device, got, *_ = compare_on_mesh(fraction, state, batch, {"data": 2, "expert": 4})
    @jax.jit
    def routing(state, b):  # the MoE layer's input and top-k, on one device
        model = nnx.merge(graphdef, state)
        layer = model.layers[0]
        x = model.embed_tokens(b["tokens"])
        attn, _ = layer.self_attn(layer.input_layernorm(x), b["positions"], b["segment_ids"])
        h = layer.post_attention_layernorm(x + attn).reshape(-1, cfg.hidden_size)
        return route(h @ layer.mlp.router[...], TOP_K, cfg.norm_topk_prob)[2]

    experts = routing(state, batch)
    valid = batch["segment_ids"].reshape(-1) > 0
    per_device = valid.size // 8
    rows = receive_rows(per_device, 4, TOP_K, EXPERTS // 4, 0.5)
    ref = gshard_dropped(np.asarray(experts), valid, data=2, num=4, local=EXPERTS // 4,
                         round_tokens=per_device, rows=rows)
    return {"mesh": float(got), "one_device": float(one_device),
            "expected": float(ref.sum() / (valid.sum() * TOP_K))}
