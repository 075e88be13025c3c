"""The hidden-split head weight's gradients under ``jax.shard_map`` on 4 CPU devices (a
subprocess, ``tests/jaxhead/test_hidden_split.py``): a custom VJP's backward pass sees the
mesh axes of ``shard_map`` (it does not see a ``jax.vmap`` axis name)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxhead
from harness.oracle import grads64, rel_err, weighted_loss
from tests.jaxhead.test_hidden_split import N, _inputs

IMPLS = {"xla-fused": ("xla", True), "xla-two_pass": ("xla", False),
         "xla_cpu-fused": ("xla_cpu", True), "xla_cpu-two_pass": ("xla_cpu", False),
         "reference": ("reference", True)}


def _relative_errors(impl: str, fused: bool, layout: str) -> dict:
    """Each device its own N / 4 tokens and H / 4 rows of the weight (FSDP): the gradient
    of ``sum(g logp + e entropy)`` over every token, against float64 autodiff."""
    hidden, weight, labels, keep, temperature, min_logit = _inputs(jnp.float32, layout)
    rng = np.random.default_rng(3)
    g = jnp.asarray(rng.standard_normal(N), jnp.float32)
    e = jnp.asarray(rng.standard_normal(N), jnp.float32)
    configs = {"xla": jaxhead.XlaConfig, "xla_cpu": jaxhead.XlaCpuConfig}
    config = None if impl == "reference" else configs[impl](
        token_chunk=16, vocab_chunk=96, fused_backward_max_bytes=2**30 if fused else 0)
    mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    w_spec = P("fsdp", None) if layout == "hv" else P(None, "fsdp")

    def local(hidden, w, labels, keep, temperature, min_logit, g, e):
        out = jaxhead.token_logprobs(
            hidden, w, labels, keep, temperature=temperature, min_logit=min_logit,
            softcap=20.0, impl=impl, config=config, weight_layout=layout, bucket=8,
            weight_hidden_axes="fsdp")
        return jax.lax.psum(jnp.sum(g * out.logprobs + e * out.entropy), "fsdp")

    run = jax.shard_map(local, mesh=mesh, out_specs=P(),
                        in_specs=(P("fsdp"), w_spec) + (P("fsdp"),) * 6)
    args = (hidden, weight, labels, keep, temperature, min_logit, g, e)
    grad = jax.jit(jax.grad(run, (0, 1)))
    dh, dw = grad(*args)
    hlo = grad.lower(*args).compile().as_text()
    w64 = weight if layout == "hv" else weight.T
    ref = weighted_loss(jaxhead.reference_token_logprobs, g, e, temperature=temperature,
                        softcap=20.0, min_logit=min_logit)
    want_dh, want_dw = grads64(ref, hidden, w64, labels, keep)
    return {"dhidden": rel_err(dh, want_dh),
            "dweight": rel_err(dw if layout == "hv" else dw.T, want_dw),
            "dweight_spec": str(dw.sharding.spec),
            "gathered": sorted(set(re.findall(r"= \w+(\[[\d,]+\])\S* all-gather\(", hlo)))}


def _invalid_label() -> dict:
    """One kept token of the first device with a label outside ``[0, V)`` under ``jit``:
    whether every device's part of the weight's gradient is NaN (as a whole weight's
    would be), and the hidden states' gradient."""
    hidden, weight, labels, keep, *_ = _inputs(jnp.float32, "hv")
    labels = labels.at[0].set(10_000)
    keep = keep.at[0].set(True)
    mesh = jax.make_mesh((4,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

    def local(hidden, w, labels, keep):
        out = jaxhead.token_logprobs(hidden, w, labels, keep, impl="xla", bucket=8,
                                     config=jaxhead.XlaConfig(token_chunk=16, vocab_chunk=96),
                                     weight_hidden_axes="fsdp")
        return jax.lax.psum(jnp.sum(jnp.where(keep, out.logprobs, 0.0)), "fsdp")

    run = jax.shard_map(local, mesh=mesh, out_specs=P(),
                        in_specs=(P("fsdp"), P("fsdp", None), P("fsdp"), P("fsdp")))
    dh, dw = jax.jit(jax.grad(run, (0, 1)))(hidden, weight, labels, keep)
    parts = np.split(np.asarray(dw), 4, axis=0)
    return {"dweight_parts_all_nan": [bool(np.isnan(p).all()) for p in parts],
            "dhidden_nan": bool(np.isnan(np.asarray(dh)).any())}


def gradient_case() -> dict:
    out = {f"{name}-{layout}": _relative_errors(*IMPLS[name], layout)
           for name in IMPLS for layout in ("hv", "vh")}
    out["invalid_label"] = _invalid_label()
    return out
