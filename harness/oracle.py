"""Random non-zero head inputs and the float64 oracle of the head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jaxhead


def head_inputs(seed, n, h, v, dtype=jnp.float32, *, peaked_fraction=0.5, exact_dot=False):
    """Random LM-like ``hidden [n, h]``, ``weight [h, v]``, ``labels [n]``.

    Bulk logits are ~N(0, 2^2); every row gets one "spike" token raised by 3..18 nats, as
    a trained LM's next-token distribution has (|logits| stay below ~25, like real heads).
    A ``peaked_fraction`` of the labels is the spike token (log-probs near 0, where
    precision matters most), the rest are uniform (log-probs around -10).

    ``exact_dot``: round hidden to multiples of 2^-4 and weight to multiples of 2^-10, so
    every product is a multiple of 2^-14 and every partial sum of a row of logits fits in
    float32's 24 bits: any float32 matmul is then exact in any summation order, and a
    comparison with float64 measures the head's own error, not the platform's matmul
    rounding (~1e-5 at H = 256 on CPU, common to every implementation).
    """
    k1, k2, k3, k4, k5, k6 = jax.random.split(jax.random.key(seed), 6)
    hidden = jax.random.normal(k1, (n, h))
    weight = jax.random.normal(k2, (h, v)) * (2.0 / np.sqrt(h))
    spike = jax.random.randint(k3, (n,), 0, v)
    w_spike = weight[:, spike].T  # [n, h]
    height = jax.random.uniform(k4, (n, 1), minval=3.0, maxval=18.0)
    hidden = hidden + height * w_spike / jnp.sum(w_spike**2, axis=1, keepdims=True)
    labels = jax.random.randint(k5, (n,), 0, v)
    labels = jnp.where(jax.random.uniform(k6, (n,)) < peaked_fraction, spike, labels)
    if exact_dot:
        hidden, weight = jnp.round(hidden * 16) / 16, jnp.round(weight * 1024) / 1024
        bound = float(jnp.max(jnp.abs(hidden)) * jnp.max(jnp.abs(weight))) * h
        assert bound < 2.0 ** (24 - 14), f"exact_dot needs smaller h: bound {bound}"
    return hidden.astype(dtype), weight.astype(dtype), labels.astype(jnp.int32)


def to64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def ref64(hidden, weight, labels, keep=None, *, temperature=1.0, softcap=None,
          min_logit=None):
    """float64 ``(logprobs, entropy)`` of the full-logits reference on the same values."""
    with jax.enable_x64(True):
        out = jaxhead.reference_token_logprobs(
            jnp.asarray(to64(hidden)), jnp.asarray(to64(weight)), jnp.asarray(labels),
            None if keep is None else jnp.asarray(keep),
            temperature=jnp.asarray(to64(temperature)), softcap=softcap,
            min_logit=None if min_logit is None else jnp.asarray(to64(min_logit)),
        )
        return np.asarray(out.logprobs), np.asarray(out.entropy)


def weighted_loss(head_fn, g_weights, e_weights, **kw):
    """``(hidden, weight) -> sum(g * logp) + sum(e * entropy)`` for a head function."""

    def loss(hidden, weight, labels, keep=None):
        out = head_fn(hidden, weight, labels, keep, **kw)
        total = 0.0
        if g_weights is not None:
            total = total + jnp.sum(g_weights * out.logprobs)
        if e_weights is not None:
            total = total + jnp.sum(e_weights * out.entropy)
        return total

    return loss


def grads64(loss, hidden, weight, labels, keep=None):
    """float64 gradients of ``loss`` w.r.t. hidden and weight, on the reference head."""
    with jax.enable_x64(True):
        g = jax.grad(loss, (0, 1))(
            jnp.asarray(to64(hidden)), jnp.asarray(to64(weight)), jnp.asarray(labels),
            None if keep is None else jnp.asarray(keep),
        )
        return tuple(np.asarray(x) for x in g)


def rel_err(x, ref):
    """``max |x - ref| / max |ref|``."""
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / np.max(np.abs(ref)))


def max_abs(a, b) -> float:
    """``max |a - b|`` in float64 (0 for empty arrays)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def max_rel(a, ref) -> float:
    """``max |a - ref| / max |ref|``."""
    return max_abs(a, ref) / float(np.max(np.abs(np.asarray(ref, np.float64))))
