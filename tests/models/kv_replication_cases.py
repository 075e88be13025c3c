"""Tensor parallelism wider than the KV heads (``models.sharding.kv_head_layout``):
multi-device cases run by ``tests.support.multidevice`` in a subprocess with 8 CPU devices
(``tests/models/test_kv_replication.py``). Each returns JSON-able measurements."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jaxhead
from harness.oracle import max_abs
from models import get_config, jit_sharded, state_shardings
from models.mesh import batch_sharding, make_mesh
from tests.models.padding_cases import packed_batch, pad, step_outputs
from tests.support.models import random_model
from train.rl import state
from train.rl.placement import Placement

#: 8 query heads on 2 KV heads: tensor=4 and tensor=8 are both wider than the KV heads.
HEADS = {"num_attention_heads": 8, "num_key_value_heads": 2}
MESHES = {"fsdp2_tensor4": {"fsdp": 2, "tensor": 4}, "tensor8": {"tensor": 8}}
#: The MoE's mesh: experts over ``expert`` and tensor=4 over the 2 KV heads.
MOE_MESHES = {"expert2_tensor4": {"expert": 2, "tensor": 4}}


def _policy(preset: str):
    """``(ModelDef, host params)`` of the random float32 ``preset`` with ``HEADS``."""
    model = random_model(get_config(preset, dtype="float32", **HEADS), seed=3)
    return state.ModelDef.of(model.cfg), jax.device_get(state.params_of(model))


def relative(a, b) -> float:
    """``max |a - b| / max |b|`` (b non-zero)."""
    return max_abs(a, b) / float(np.max(np.abs(np.asarray(b, np.float64))))


def grpo_case(preset: str = "tiny", meshes: dict = MESHES, row_len: int = 16) -> dict:
    """The trainer's GRPO step (``train.rl.steps.grpo_loss_fn``) of the random ``preset``
    (float32) on a packed batch (several sequences per row, tail padding, two padding
    rows), on each of ``meshes`` vs one device: the relative error of the loss, of the
    log-probs and entropy on the kept tokens and of every parameter's gradient; the
    placement of the K/V projections."""
    mdef, params = _policy(preset)
    arrays, num_seqs = packed_batch(rows=6, row_len=row_len)
    arrays = pad(arrays, rows=2)
    keep = arrays["loss_mask"] > 0
    ref = step_outputs(mdef, params, arrays, num_seqs, jaxhead.bucket_for_shards(
        keep, 1, multiple=16))
    out = {"kept": int(keep.sum()), "padding_rows": int((~keep.any(axis=1)).sum())}
    for name, sizes in meshes.items():
        placement = Placement(make_mesh(sizes), mdef)
        got = step_outputs(mdef, params, arrays, num_seqs,
                           placement.shard_bucket(keep, multiple=16), placement)
        grads = {k: relative(got["grads"][k], g) for k, g in ref["grads"].items()}
        out[name] = {
            "loss": relative(got["loss"], ref["loss"]),
            "logp": relative(np.asarray(got["logp"])[keep], np.asarray(ref["logp"])[keep]),
            "entropy": relative(np.asarray(got["entropy"])[keep],
                                np.asarray(ref["entropy"])[keep]),
            "grads": grads,
            "k_proj_spec": str(placement.params[_key(params, "k_proj")].spec),
            "q_proj_spec": str(placement.params[_key(params, "q_proj")].spec),
        }
    return out


def _key(params: dict, name: str) -> str:
    return next(k for k in sorted(params) if k.endswith(name))


def decode_case() -> dict:
    """Greedy and sampled rollouts (``train.rl.rollout.Generator``, KV cache split over the
    batch axes) of the random ``tiny`` with ``HEADS`` on fsdp=2 x tensor=4 vs one device."""
    from tests.train.rollout_cases import _rollouts

    mdef, params = _policy("tiny")
    mesh = _rollouts(mdef, params, Placement(make_mesh(MESHES["fsdp2_tensor4"]), mdef))
    one = _rollouts(mdef, params, None)
    return {"mesh": mesh, "one_device": one}


def kernels_case() -> dict:
    """One ``Attention`` layer (8 query heads on 2 KV heads, float32) running each attention
    kernel (Pallas interpret mode: it must take whole KV heads per tensor shard, or raise
    ``KernelUnsupported``) on fsdp=2 x tensor=4, vs the ``"dense"`` reference on one
    device: the output on real tokens and the gradients of the layer's weights and input
    (cotangent zero on padding, whose kernel output differs by design)."""
    b, t = 4, 128
    rng = np.random.default_rng(7)
    seg = np.zeros((b, t), np.int32)
    pos = np.zeros((b, t), np.int32)
    for row, lengths in enumerate([[50, 60], [128], [30, 40, 20], [100]]):
        start = 0
        for i, length in enumerate(lengths):
            seg[row, start:start + length] = i + 1
            pos[row, start:start + length] = np.arange(length)
            start += length
    x = jnp.asarray(rng.standard_normal((b, t, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((b, t, 64)) * (seg != 0)[..., None], jnp.float32)
    mesh = make_mesh(MESHES["fsdp2_tensor4"])

    def grads(impl):
        cfg = get_config("tiny", dtype="float32", attention_impl=impl, **HEADS)
        graphdef, params = nnx.split(random_model(cfg, seed=3).layers[0].self_attn)

        def loss(params, x):
            y, _ = nnx.merge(graphdef, params)(x, jnp.asarray(pos), jnp.asarray(seg))
            return jnp.sum(y * w), y

        return jax.value_and_grad(loss, (0, 1), has_aux=True), params

    fn, params = grads("dense")
    (_, ref_y), ref_g = jax.jit(fn)(params, x)
    real = seg != 0
    out = {}
    for impl in ("splash", "pallas_gpu"):
        fn, params = grads(impl)
        shardings = state_shardings(params, mesh)
        run = jit_sharded(fn, mesh, in_shardings=(shardings, batch_sharding(mesh)))
        (_, y), g = run(jax.device_put(params, shardings), x)
        out[impl] = {"value": relative(np.asarray(y)[real], np.asarray(ref_y)[real]),
                     "grads": {jax.tree_util.keystr(p): relative(a, r) for (p, a), r in zip(
                         jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(ref_g),
                         strict=True)}}
    return out


def case() -> dict:
    """Every case above in one subprocess: the dense model's GRPO step on ``MESHES``, the
    MoE's on ``MOE_MESHES``, the rollouts and the kernels."""
    return {"dense": grpo_case("tiny"), "moe": grpo_case("tiny-moe", MOE_MESHES),
            "decode": decode_case(), "kernels": kernels_case()}
