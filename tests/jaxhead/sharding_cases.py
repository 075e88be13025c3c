"""Multi-device cases of the sharded head, run by ``tests.support.multidevice`` in a
subprocess with 8 CPU devices (``tests/jaxhead/test_sharded_head.py``). The mesh is a plain
``jax.make_mesh``: jaxhead takes a mesh and axis names, whatever their meaning."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType

import jaxhead
from harness.oracle import head_inputs, max_abs, max_rel

HEAD_CONFIGS = {
    "tokens": {"token_axes": ("data", "expert"), "vocab_axis": None},
    "vocab_parallel": {"token_axes": ("data",), "vocab_axis": "expert"},
}


def mesh_2x4(axis_types=None):
    """A ``("data", "expert")`` mesh of 2 x 4 CPU devices: ``jax.make_mesh``'s default axis
    types (Explicit), or ``axis_types``."""
    return jax.make_mesh((2, 4), ("data", "expert"), axis_types=axis_types)


def head_case() -> dict:
    """Sharded head vs ``jaxhead.token_logprobs`` on one device: values and gradients of
    ``sum(g * logp) + sum(e * entropy)``, per-token temperatures, soft-cap, uneven keep, and
    truncated supports (``min_logit``: the 20th largest tempered logit, every third token
    untruncated)."""
    mesh = mesh_2x4()
    b, s, h, v = 8, 96, 64, 2048
    hidden, weight, labels = head_inputs(0, b * s, h, v)
    hidden, labels = hidden.reshape(b, s, h), labels.reshape(b, s)
    rng = np.random.default_rng(0)
    keep = rng.random((b, s)) < np.linspace(0.1, 0.6, b)[:, None]  # uneven across shards
    temp = rng.uniform(0.6, 1.4, (b, s)).astype(np.float32)
    g = (rng.standard_normal((b, s)) / keep.sum()).astype(np.float32)
    e = (rng.standard_normal((b, s)) / keep.sum()).astype(np.float32)
    z = np.asarray(hidden @ weight, np.float64)
    l = np.sort(25.0 * np.tanh(z / 25.0) / temp[..., None], axis=-1)
    min_logit = np.where(np.arange(s) % 3 == 0, -np.inf, (l[..., -20] + l[..., -21]) / 2)
    kw = {"temperature": temp, "softcap": 25.0, "min_logit": min_logit.astype(np.float32),
          "config": jaxhead.XlaConfig(token_chunk=16, vocab_chunk=192)}

    def value_and_grad(head):
        def loss(hd, w):
            out = head(hd, w)
            return jnp.sum(g * out.logprobs) + jnp.sum(e * out.entropy), out

        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(hidden, weight)

    (_, ref), ref_grads = value_and_grad(
        lambda hd, w: jaxhead.token_logprobs(hd, w, labels, keep, **kw))
    results = {}
    for name, axes in HEAD_CONFIGS.items():
        shards = int(np.prod([dict(mesh.shape)[a] for a in axes["token_axes"]]))
        bucket = jaxhead.bucket_for_shards(keep, shards, multiple=16)
        (_, out), grads = value_and_grad(
            lambda hd, w, axes=axes, bucket=bucket: jaxhead.sharded_token_logprobs(
                hd, w, labels, keep, mesh=mesh, bucket=bucket, **axes, **kw))
        results[name] = {
            "logprobs": max_abs(out.logprobs, ref.logprobs),
            "entropy": max_abs(out.entropy, ref.entropy),
            "dhidden": max_abs(grads[0], ref_grads[0]),
            "dweight": max_abs(grads[1], ref_grads[1]),
            "dhidden_rel": max_rel(grads[0], ref_grads[0]),
            "dweight_rel": max_rel(grads[1], ref_grads[1]),
            "bucket": bucket,
            "tokens_per_shard": b * s // shards,
            "out_spec": str(out.logprobs.sharding.spec),
        }
    return results


def weight_layout_case() -> dict:
    """The sharded head with a ``[V, H]`` weight (``weight_layout="vh"``, the vocab-parallel
    split along its dim 0) vs ``jaxhead.token_logprobs`` with ``[H, V]`` on one device: max
    differences of values and gradients (the weight's transposed back), the weight
    gradient's shape and, vocab-parallel, its sharding."""
    mesh = mesh_2x4()
    b, s, h, v = 8, 32, 64, 2048
    hidden, weight, labels = head_inputs(1, b * s, h, v)
    hidden, labels = hidden.reshape(b, s, h), labels.reshape(b, s)
    rng = np.random.default_rng(1)
    keep = rng.random((b, s)) < 0.5
    temp = rng.uniform(0.6, 1.4, (b, s)).astype(np.float32)
    g = (rng.standard_normal((b, s)) / keep.sum()).astype(np.float32)
    e = (rng.standard_normal((b, s)) / keep.sum()).astype(np.float32)
    kw = {"temperature": temp, "softcap": 25.0,
          "config": jaxhead.XlaConfig(token_chunk=16, vocab_chunk=192)}

    def value_and_grad(head, w):
        def loss(hd, w):
            out = head(hd, w)
            return jnp.sum(g * out.logprobs) + jnp.sum(e * out.entropy), out

        return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(hidden, w)

    (_, ref), ref_grads = value_and_grad(
        lambda hd, w: jaxhead.token_logprobs(hd, w, labels, keep, **kw), weight)
    results = {}
    for name, axes in HEAD_CONFIGS.items():
        (_, out), (dh, dw) = value_and_grad(
            lambda hd, w, axes=axes: jaxhead.sharded_token_logprobs(
                hd, w, labels, keep, mesh=mesh, weight_layout="vh", **axes, **kw), weight.T)
        results[name] = {
            "logprobs": max_abs(out.logprobs, ref.logprobs),
            "entropy": max_abs(out.entropy, ref.entropy),
            "dhidden": max_abs(dh, ref_grads[0]),
            "dweight": max_abs(dw.T, ref_grads[1]),
            "dweight_shape": list(dw.shape),
            "dweight_spec": str(dw.sharding.spec),
        }
    # a kept label outside [0, V) under jit: NaN in its log-prob and in both gradients
    bad = labels.at[0, int(np.flatnonzero(keep[0])[0])].set(v)

    def bad_loss(hd, w, y):  # traced labels: no eager check
        out = jaxhead.sharded_token_logprobs(hd, w, y, keep, mesh=mesh, weight_layout="vh",
                                             **HEAD_CONFIGS["vocab_parallel"], **kw)
        return jnp.sum(jnp.where(keep, out.logprobs, 0.0))

    loss, (dh, dw) = jax.jit(jax.value_and_grad(bad_loss, (0, 1)))(hidden, weight.T, bad)
    results["invalid_label"] = {"loss_nan": bool(jnp.isnan(loss)),
                                "dhidden_nan": bool(jnp.isnan(dh).any()),
                                "dweight_all_nan": bool(jnp.isnan(dw).all())}
    return results


def mesh_types_case() -> dict:
    """The sharded head on meshes of each axis type: ``jax.make_mesh``'s default (Explicit
    axes; ``head_case`` runs it under ``jit`` with gradients) eagerly, with the mesh set
    by ``jax.set_mesh`` (``mesh=None``) and through ``LMHead.sharded``; Auto axes and a mix
    under ``jit``, vocab-parallel (the token split alone on Auto axes: the other cases). Max |log-prob - one device| of each way, or the error it raised."""
    b, s, h, v = 8, 4, 16, 64
    hidden, weight, labels = head_inputs(2, b * s, h, v)
    hidden, labels = hidden.reshape(b, s, h), labels.reshape(b, s)
    keep = np.random.default_rng(2).random((b, s)) < 0.5
    ref = jaxhead.token_logprobs(hidden, weight, labels, keep).logprobs
    head = jaxhead.LMHead(h, v, rngs=nnx.Rngs(0))
    head.kernel[...] = weight
    default, auto = mesh_2x4(), mesh_2x4((AxisType.Auto,) * 2)
    mixed = mesh_2x4((AxisType.Explicit, AxisType.Auto))
    tokens, vocab = HEAD_CONFIGS["tokens"], HEAD_CONFIGS["vocab_parallel"]

    def head_fn(mesh, axes):
        return lambda hd, w: jaxhead.sharded_token_logprobs(hd, w, labels, keep, mesh=mesh,
                                                            **axes).logprobs

    def in_context(mesh, axes):
        with jax.set_mesh(mesh):
            return jax.jit(head_fn(None, axes))(hidden, weight)

    ways = {
        "default/tokens/eager": lambda: head_fn(default, tokens)(hidden, weight),
        "default/vocab_parallel/eager": lambda: head_fn(default, vocab)(hidden, weight),
        "default/vocab_parallel/set_mesh": lambda: in_context(default, vocab),
        "default/tokens/lmhead": lambda: head.sharded(hidden, labels, keep, mesh=default,
                                                      **tokens).logprobs,
        "auto/vocab_parallel/jit": lambda: jax.jit(head_fn(auto, vocab))(hidden, weight),
        "mixed/vocab_parallel/jit": lambda: jax.jit(head_fn(mixed, vocab))(hidden, weight),
    }
    results = {}
    for way, call in ways.items():
        try:
            results[way] = max_abs(call(), ref)
        except Exception as err:  # noqa: BLE001 - the error is the measurement
            results[way] = f"{type(err).__name__}: {err}"[:300]
    return results
