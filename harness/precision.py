"""Every head implementation behind one call, and its error against float64 beside the
plain float32 full-logits head's: what ``tests/jaxhead/test_precision.py`` bounds and
``benchmarks/accuracy.py`` prints."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxhead
from harness.oracle import grads64, max_abs, max_rel, ref64, weighted_loss
from jaxhead._src.head import xla
from jaxhead._src.head.base import HeadSpec
from jaxhead._src.head.scan import Tuning

#: Small kernel tiles, so that small inputs cross several tiles.
KERNELS = {"pallas_tpu": jaxhead.PallasTpuConfig(16, 256),
           "pallas_triton": jaxhead.PallasTritonConfig(16, 256, 32, num_warps=4, num_stages=2)}
IMPLS = ("xla", "xla_cpu", "pallas_tpu", "pallas_triton", "vocab_parallel")


def vocab_parallel(hidden, weight, labels, keep=None, *, temperature=1.0, softcap=None,
                   min_logit=None, shards=2):
    """The XLA head in vocab-parallel mode, ``jax.vmap`` with an axis name standing in for
    a mesh axis of ``shards`` devices; the same contract as ``jaxhead.token_logprobs``
    (``keep`` must be None)."""
    assert keep is None
    n, (h, v) = labels.shape[0], weight.shape
    spec = HeadSpec(n, h, v, jnp.dtype(hidden.dtype).name, softcap, True, "v", shards,
                    truncated=min_logit is not None)
    plan, padded = xla.make_plan(jaxhead.XlaConfig(token_chunk=16, vocab_chunk=96), spec,
                                 Tuning())
    pad = padded - n
    temperature = jnp.pad(jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (n,)),
                          (0, pad), constant_values=1.0)
    w_shards = weight.reshape(h, shards, v // shards).transpose(1, 0, 2)
    ml = jnp.full((n,), -jnp.inf) if min_logit is None else jnp.asarray(min_logit, jnp.float32)
    ml = jnp.pad(ml, (0, pad), constant_values=-jnp.inf)

    def one(w):
        return xla.chunked_head(plan, jnp.pad(hidden, ((0, pad), (0, 0))), w,
                                jnp.pad(labels, (0, pad)), temperature, ml)

    logp, ent = jax.vmap(one, axis_name="v")(w_shards)
    return jaxhead.HeadOutput(logp[0, :n], ent[0, :n])


def head(impl: str):
    """``head(hidden, weight, labels, keep=None, **kw) -> HeadOutput`` for ``impl`` (one of
    ``IMPLS``; kernels in Pallas interpret mode, small tiles)."""
    if impl == "vocab_parallel":
        return vocab_parallel
    if impl in KERNELS:
        def kernel(*args, **kw):
            with jaxhead.pallas_interpret():
                return jaxhead.token_logprobs(*args, config=KERNELS[impl], **kw)
        return kernel
    config = {"xla": jaxhead.XlaConfig, "xla_cpu": jaxhead.XlaCpuConfig}[impl]
    return lambda *args, **kw: jaxhead.token_logprobs(
        *args, config=config(token_chunk=16, vocab_chunk=96), **kw)


def plain32(hidden, weight, labels, keep=None, **kw):
    """The plain float32 full-logits head (what naive JAX code does)."""
    return jaxhead.reference_token_logprobs(hidden, weight, labels, keep, **kw)


def logit_rounding(hidden, weight, temperature=1.0) -> float:
    """Largest float32 rounding of the tempered logits (``jnp.dot`` vs float64): what no
    float32 implementation gets below."""
    t = np.float64(np.float32(temperature))
    exact = np.asarray(hidden, np.float64) @ np.asarray(weight, np.float64) / t
    return max_abs(jnp.dot(hidden, weight) * np.float32(1.0 / np.float32(temperature)), exact)


def errors(impl, hidden, weight, labels, **kw) -> tuple[dict, dict, float]:
    """``(impl's errors, plain float32's errors, floor)``: max abs error of ``logp`` and
    ``entropy`` and max relative error of the gradients ``dh``, ``dw`` of
    ``sum(g logp) + sum(e entropy)`` (random ``g``, ``e``) against float64 on the same
    inputs; ``floor``: twice the float32 rounding of the tempered logits plus one ulp of
    the largest log-prob (what no float32 method gets below)."""
    n = labels.shape[0]
    g = jax.random.normal(jax.random.key(1), (n,))
    e = jax.random.normal(jax.random.key(2), (n,))
    ref_lp, ref_ent = ref64(hidden, weight, labels, **kw)
    ref_grads = grads64(weighted_loss(jaxhead.reference_token_logprobs, g, e, **kw),
                        hidden, weight, labels)
    results = []
    for fn in (head(impl), plain32):
        out = fn(hidden, weight, labels, **kw)
        grads = jax.grad(weighted_loss(fn, g, e, **kw), (0, 1))(hidden, weight, labels)
        results.append({"logp": max_abs(out.logprobs, ref_lp),
                        "entropy": max_abs(out.entropy, ref_ent),
                        "dh": max_rel(grads[0], ref_grads[0]),
                        "dw": max_rel(grads[1], ref_grads[1])})
    floor = 2 * logit_rounding(hidden, weight, kw.get("temperature", 1.0))
    floor += float(np.spacing(np.float32(np.max(np.abs(ref_lp)))))
    return results[0], results[1], floor
