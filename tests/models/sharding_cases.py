"""Multi-device test cases of the models, run by ``tests.support.multidevice`` in a
subprocess with several CPU devices (``tests/models/test_*.py``). Each returns JSON-able
measurements.

``compare_on_mesh`` is the reusable hook: it runs one step plain on a single device (the
reference) and sharded on a mesh, and reports the largest difference of every output.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

import jaxhead
from harness.oracle import head_inputs, max_abs
from models import get_config, jit_sharded, state_shardings
from models.mesh import AXES, BATCH_AXES, batch_sharding, make_mesh, present
from models.moe.api import routed_experts, tokens_per_dispatch
from models.moe.reference import dropless_experts
from tests.support.models import random_model
from train.rl.placement import place_batch
from train.run.distributed import initialize_distributed

MOE_MESH = {"data": 2, "expert": 4}


def compare_on_mesh(step, state, batch, mesh_config, reference=None):
    """Run ``step`` sharded on a mesh and ``reference`` (default ``step``) on one device.

    Args:
      step: ``step(state, batch) -> pytree of arrays``, run under
        ``models.jit_sharded`` (so the MoE is expert-parallel) with ``state`` placed by
        ``models.state_shardings`` and ``batch`` split over the batch axes.
      state: an ``nnx.State`` (model parameters, optimizer state, ...) whose variables
        carry logical axes.
      batch: pytree of host arrays ``[B, ...]``.
      mesh_config: ``models.mesh.MeshConfig`` fields, e.g. ``{"data": 2, "expert": 4}``,
        or a ``jax.sharding.Mesh`` with the ``models.mesh`` axes (of any axis types: the
        state is placed on it as given).
      reference: the single-device step, ``jax.jit`` without a mesh (default ``step``).

    Returns:
      ``(diffs, reference outputs, sharded outputs, lowered sharded step, sharded state)``
      where ``diffs`` maps each output leaf's key path to its max absolute difference.
    """
    ref_out = jax.jit(reference or step)(state, batch)
    mesh = mesh_config if isinstance(mesh_config, Mesh) else make_mesh(mesh_config)
    shardings = state_shardings(state, mesh)
    placed = jax.device_put(state, jax.tree.map(lambda s: NamedSharding(mesh, s.spec),
                                                shardings))
    sharded_batch = place_batch(batch, mesh, per_process=True)
    run = jit_sharded(step, mesh, in_shardings=(shardings, batch_sharding(mesh)))
    out = run(placed, sharded_batch)
    diffs = {
        jax.tree_util.keystr(path): max_abs(a, b)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out),
                                jax.tree.leaves(ref_out), strict=True)
    }
    return diffs, ref_out, out, run.lower(placed, sharded_batch), placed


# ----------------------------------------------------------------------------- models

def moe_inputs(seed: int = 1, batch: int = 8, seq: int = 16):
    """A batch of packed-style rows for the tiny MoE: random tokens, padded row ends
    (segment id 0), labels by ``next_token_labels``, a random keep mask and advantages."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, (batch, seq)).astype(np.int32)
    lengths = rng.integers(seq // 2, seq + 1, batch)
    segment_ids = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq, dtype=np.int32), (batch, seq)).copy()
    labels, valid = jaxhead.next_token_labels(jnp.asarray(tokens), jnp.asarray(segment_ids))
    keep = np.asarray(valid) & (rng.random((batch, seq)) < 0.75)
    return {
        "tokens": tokens, "positions": positions, "segment_ids": segment_ids,
        "labels": np.asarray(labels).astype(np.int32), "keep": keep,
        "advantages": rng.standard_normal((batch, seq)).astype(np.float32),
    }


def moe_model(dtype="float32"):
    """``(graphdef, state)`` of the random tiny Qwen3-MoE (8 experts, top-2, 2 layers)."""
    return nnx.split(random_model(get_config("tiny-moe", dtype=dtype), seed=3))


def rl_loss_step(graphdef, bucket: int, sharded: bool, with_grads: bool = True):
    """A policy-gradient-shaped step: decoder, head on the kept tokens,
    ``-mean(adv * logp) - 0.01 mean(entropy) + 0.01 aux``; returns
    ``(loss, hidden, logprobs, entropy, aux, grads)`` (grads omitted without ``with_grads``).
    ``sharded`` picks ``LMHead.sharded`` (mesh) or ``LMHead.__call__`` (one device)."""

    def loss_fn(state, batch):
        model = nnx.merge(graphdef, state)
        out = model(batch["tokens"], batch["positions"], batch["segment_ids"])
        if sharded:
            axes = present(jax.sharding.get_abstract_mesh(), BATCH_AXES)
            res = model.lm_head.sharded(out.hidden, batch["labels"], batch["keep"],
                                        token_axes=axes, bucket=bucket)
        else:
            res = model.lm_head(out.hidden, batch["labels"], batch["keep"], bucket=bucket)
        count = jnp.maximum(jnp.sum(batch["keep"]), 1)
        loss = (-jnp.sum(batch["advantages"] * res.logprobs) / count
                - 0.01 * jnp.sum(res.entropy) / count + 0.01 * out.aux_loss)
        return loss, (out.hidden, res.logprobs, res.entropy, out.aux_loss)

    def step(state, batch):
        if not with_grads:
            return loss_fn(state, batch)
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state, batch)
        return loss, aux, grads

    return step


def _collectives(hlo: str, expert_shapes) -> dict:
    gathers = [line for line in hlo.splitlines() if re.search(r"\ball-gather(-start)?\(", line)]
    full = [line.strip()[:160] for line in gathers
            if any(f"[{','.join(map(str, s))}]" in line for s in expert_shapes)]
    return {
        "all_to_all": len(re.findall(r"\ball-to-all(-start)?\(", hlo)),
        "all_gathers": len(gathers),
        "full_expert_gathers": full,
    }


def _dispatch_rounds(mesh) -> dict:
    """The expert-parallel layer with its tokens sent in 4 all-to-all rounds (a small
    ``max_rows``) vs ``models.moe.reference.dropless_experts``: values and gradients."""
    rng = np.random.default_rng(4)
    tokens, h, i, e, k = 128, 32, 16, 8, 2  # 16 tokens per device, 2 experts per device
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    logits = jnp.asarray(rng.standard_normal((tokens, e)) * 2, jnp.float32)
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits), k)
    params = tuple(jnp.asarray(rng.standard_normal(s) / 4, jnp.float32)
                   for s in ((e, h, i), (e, h, i), (e, i, h)))
    cotangent = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    rounds = tokens // 8 // tokens_per_dispatch(tokens // 8, 4, k, 2, 32)

    def vjp(layer):
        out, pull = jax.vjp(lambda x, *p: layer(x, experts, weights, *p), x, *params)
        return out, pull(cotangent)

    def sharded(*args):
        return routed_experts(*args, mesh=mesh, max_rows=32)[0]

    ref = jax.jit(lambda: vjp(dropless_experts))()
    with jax.set_mesh(mesh):
        got = jax.jit(lambda: vjp(sharded))()
    return {"rounds": rounds, "value": max_abs(got[0], ref[0]),
            "grads": max(max_abs(a, b) for a, b in zip(got[1], ref[1], strict=True))}


def moe_case() -> dict:
    """Tiny Qwen3-MoE on data=2 x expert=4 vs one device: forward, head, loss and every
    gradient; the compiled step's collectives; the expert weights' shard shapes. Then the
    forward on fsdp=2 x expert=2 x tensor=2."""
    graphdef, state = moe_model()
    batch = moe_inputs()
    keep = batch["keep"]
    single_bucket = jaxhead.bucket_size(int(keep.sum()), keep.size, multiple=16)
    mesh = make_mesh(MOE_MESH)
    bucket = jaxhead.bucket_for_shards(keep, 8, multiple=16)
    diffs, _, out, lowered, placed = compare_on_mesh(
        rl_loss_step(graphdef, bucket, sharded=True), state, batch, MOE_MESH,
        reference=rl_loss_step(graphdef, single_bucket, sharded=False),
    )
    cfg = get_config("tiny-moe")
    e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    hlo = lowered.compile().as_text()
    shards = {}
    for path, var in nnx.to_flat_state(placed):
        if path[-1] in ("gate_proj", "up_proj", "down_proj") and "mlp" in path:
            arr = var[...]
            shards["/".join(map(str, path))] = {
                "global": list(arr.shape),
                "shard": list(arr.sharding.shard_shape(arr.shape)),
                "addressable": sorted({tuple(s.data.shape) for s in arr.addressable_shards}),
            }
    grad_diff = max(v for k, v in diffs.items() if k.startswith("[2]"))
    fwd_diffs, *_ = compare_on_mesh(  # on jax.make_mesh's default mesh: Explicit axes
        rl_loss_step(graphdef, jaxhead.bucket_for_shards(keep, 4, multiple=16), True,
                     with_grads=False),
        state, batch, jax.make_mesh((1, 2, 2, 1, 2), AXES),
        reference=rl_loss_step(graphdef, single_bucket, False, with_grads=False),
    )
    return {
        "rounds": _dispatch_rounds(mesh),
        "loss": diffs["[0]"], "hidden": diffs["[1][0]"], "logprobs": diffs["[1][1]"],
        "entropy": diffs["[1][2]"], "aux": diffs["[1][3]"], "grads": grad_diff,
        "grad_leaves": sum(k.startswith("[2]") for k in diffs),
        "num_experts": e, "expert_axis": MOE_MESH["expert"],
        "collectives": _collectives(hlo, [(e, h, i), (e, i, h)]),
        "expert_shards": shards,
        "fsdp_tensor_forward": {
            "hidden": fwd_diffs["[1][0]"], "logprobs": fwd_diffs["[1][1]"],
            "loss": fwd_diffs["[0]"],
        },
        "bucket": bucket, "single_bucket": single_bucket,
        "out_spec": str(out[1][1].sharding.spec),
    }


def distributed_forward_case() -> dict:
    """The tiny MoE step (loss, head and gradients) on data=2 x expert=2 over 4 devices.

    Run either as 2 processes x 2 devices (``jax.distributed`` from the environment,
    each process feeding its half of the batch and agreeing on the bucket with a
    collective) or as 1 process x 4 devices; the two must return the same numbers.
    """
    if "JAX_NUM_PROCESSES" in __import__("os").environ:
        initialize_distributed()
    mesh_config = {"data": 2, "expert": 2}
    mesh = make_mesh(mesh_config)
    graphdef, state = moe_model()
    batch = moe_inputs(seed=5)
    batch["keep"][:4] &= batch["positions"][:4] < 6  # process 0's shards keep fewer tokens
    rows = batch["tokens"].shape[0] // jax.process_count()
    mine = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
    local = {k: v[mine] for k, v in batch.items()}
    bucket = jaxhead.bucket_for_shards(local["keep"], jax.local_device_count(), multiple=16,
                                       across_processes=True)
    local_shards = local["keep"].reshape(jax.local_device_count(), -1)
    own_bucket = jaxhead.bucket_size(int(local_shards.sum(axis=1).max()),
                                     local_shards.shape[1], multiple=16)
    shardings = state_shardings(state, mesh)
    run = jit_sharded(rl_loss_step(graphdef, bucket, sharded=True), mesh,
                      in_shardings=(shardings, batch_sharding(mesh)))
    loss, (hidden, logp, ent, aux), grads = run(jax.device_put(state, shardings),
                                                place_batch(local, mesh, per_process=True))

    def host(x):
        return np.asarray(multihost_utils.process_allgather(x, tiled=True), np.float64)

    return {
        "processes": jax.process_count(), "devices": jax.device_count(), "bucket": bucket,
        "own_bucket": own_bucket,
        "loss": float(host(loss)), "aux": float(host(aux)),
        "logprobs": host(logp).ravel().tolist(), "entropy": host(ent).ravel().tolist(),
        "hidden_sum": host(hidden).sum(axis=-1).ravel().tolist(),
        "grad_norms": {jax.tree_util.keystr(p): float(np.sqrt(np.sum(host(g) ** 2)))
                       for p, g in jax.tree_util.tree_leaves_with_path(grads)},
    }


def errors_case() -> dict:
    """Bad input on 8 devices, each caught before anything compiles: the message of each."""
    messages = {}

    def catch(name, fn):
        try:
            fn()
        except ValueError as err:
            messages[name] = str(err)

    catch("mesh", lambda: make_mesh({"data": 4, "expert": 4}))
    mesh = make_mesh(MOE_MESH)
    catch("place_batch", lambda: place_batch({"tokens": np.zeros((6, 16), np.int32)}, mesh))
    graphdef, state = moe_model()
    batch = {k: v[:3, :4] for k, v in moe_inputs().items()}  # 12 tokens over 8 shards
    step = jit_sharded(rl_loss_step(graphdef, 16, sharded=False, with_grads=False), mesh)
    catch("moe_tokens", lambda: step(state, batch))
    hidden, weight, labels = head_inputs(0, 6 * 8, 32, 256)
    catch("head_batch", lambda: jaxhead.sharded_token_logprobs(
        hidden.reshape(6, 8, 32), weight, labels.reshape(6, 8), mesh=mesh,
        token_axes=present(mesh, BATCH_AXES)))
    return messages


def attention_kernels_case() -> dict:
    """The attention kernels (Pallas interpret mode) on a data=2 x fsdp=2 x tensor=2 mesh:
    ``self_attention`` runs them inside ``jax.shard_map`` (rows over data x fsdp, heads
    over tensor); forward and gradients against the dense reference; what ``"auto"``
    picks on a CPU mesh; rows that do not split over the batch axes."""
    from jaxhead.dispatch import KernelUnsupported, target_platform
    from models.attention.api import REGISTRY, self_attention
    from models.attention.reference import dense_attention

    b, t, n, kv, d = 4, 256, 4, 2, 32
    keys = jax.random.split(jax.random.key(5), 4)
    q = jax.random.normal(keys[0], (b, t, n, d))
    k, v = (jax.random.normal(x, (b, t, kv, d)) for x in keys[1:3])
    w = jax.random.normal(keys[3], (b, t, n, d))
    lengths = [[100, 120], [256], [30, 60, 90], [200]]
    seg = np.zeros((b, t), np.int32)
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    for row, ls in enumerate(lengths):
        start = 0
        for i, length in enumerate(ls):
            seg[row, start:start + length] = i + 1
            pos[row, start:start + length] = np.arange(length)
            start += length
    real = jnp.asarray(seg != 0)[:, :, None, None]

    def grads(fn):
        loss = lambda q, k, v: (fn(q, k, v) * w * real).sum()
        return jax.value_and_grad(loss, (0, 1, 2))(q, k, v)

    ref = grads(lambda q, k, v: dense_attention(q, k, v, pos, seg, pos, seg, scale=0.2))
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    out = {}
    for impl in ("splash", "pallas_gpu"):
        attn = lambda q, k, v, impl=impl: self_attention(q, k, v, pos, seg, scale=0.2,
                                                         impl=impl)
        with jax.set_mesh(mesh):
            got = jax.jit(lambda q, k, v, attn=attn: grads(attn))(q, k, v)
            hlo = jax.jit(attn).lower(q, k, v).as_text()
        out[impl] = {"loss": max_abs(got[0], ref[0]),
                     "grads": max(max_abs(g, r) for g, r in zip(got[1], ref[1])),
                     "shard_map": "shard_map" in hlo or "sdy.manual_computation" in hlo}
    with jax.set_mesh(mesh):
        out["auto_on_cpu_mesh"] = REGISTRY.candidates(target_platform())[0]
        try:
            self_attention(q[:3], k[:3], v[:3], pos[:3], seg[:3], scale=0.2, impl="splash")
            out["three_rows"] = "ran"
        except KernelUnsupported as err:
            out["three_rows"] = str(err)
    return out
