"""Inputs, oracle and comparison shared by the Pallas kernel tests (interpret mode, CPU).

The oracle is the XLA chunked path (``impl="xla"``). Every quantity the kernels produce is
compared: log-probs, entropy, and the gradients w.r.t. hidden and weight of a loss that
reads both (mean-normalised, as an RL loss is).
"""

from __future__ import annotations

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np

import jaxhead
from jaxhead._src.head import api
from jaxhead._src.head.base import HeadSpec

HIDDEN = 128
TOL = {jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.bfloat16): 1e-3}


@dataclasses.dataclass(frozen=True)
class Case:
    """One test configuration: ``n`` rows, ``vocab`` columns, options of the head."""

    n: int
    vocab: int
    dtype: str
    softcap: float | None = None
    token_temp: bool = True
    with_entropy: bool = True
    seed: int = 0

    def __str__(self):
        parts = [f"n{self.n}", f"v{self.vocab}", self.dtype]
        parts += [f"cap{self.softcap}"] if self.softcap else []
        parts += ["tokentemp" if self.token_temp else "scalartemp"]
        parts += [] if self.with_entropy else ["noent"]
        return "-".join(parts)


def inputs(case: Case):
    """Random non-zero ``(h, w, labels, temperature, g, e)``: ``h`` ~ N(0, 1), ``w`` scaled so
    logits have std ~3.4 (peaked rows), temperatures in [0.5, 2], loss weights ~ N(0, 1/n)."""
    dtype = jnp.dtype(case.dtype)
    k = jax.random.split(jax.random.key(case.seed), 6)
    n, v = case.n, case.vocab
    h = jax.random.normal(k[0], (n, HIDDEN), jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(k[1], (HIDDEN, v), jnp.float32)).astype(dtype)
    labels = jax.random.randint(k[2], (n,), 0, v, jnp.int32)
    if case.token_temp:
        temperature = jax.random.uniform(k[3], (n,), jnp.float32, 0.5, 2.0)
    else:
        temperature = jnp.full((n,), 0.7, jnp.float32)
    g = jax.random.normal(k[4], (n,), jnp.float32) / n
    e = jax.random.normal(k[5], (n,), jnp.float32) / n
    return h, w, labels, temperature, g, e


def swap_head(monkeypatch, name: str, **changes) -> None:
    """Make ``impl=name`` run its implementation with ``changes`` (``make_plan``, ``head``:
    ``base.Implementation`` fields), in the same registry entry (platforms, probe)."""
    entry = api.REGISTRY[name]
    head = dataclasses.replace(entry.call, **changes)
    monkeypatch.setattr(api, "REGISTRY", api.REGISTRY.replace(api.head_entry(
        name, head, entry.platforms, kernel=entry.probe is not None, auto=entry.auto)))


def head_fn(impl: str, case: Case, config=None, hidden: int = HIDDEN, mode="interpret",
            truncated: bool = False):
    """``head(h, w, labels, temperature, min_logit=None) -> (logp, entropy)`` of implementation
    ``impl`` on ``case.n`` rows (padded to its tiles and sliced back by
    ``api.run_compacted``), planned with ``config`` in Pallas ``mode``; ``truncated``: the
    plan reads ``min_logit``."""
    spec = HeadSpec(case.n, hidden, case.vocab, case.dtype, case.softcap, case.with_entropy,
                    truncated=truncated)
    with jaxhead.pallas_interpret(mode):
        chosen, made, padded = api.plan(impl, config, spec)

    def head(h, w, labels, temperature, min_logit=None):
        ml = jnp.full(labels.shape, -jnp.inf) if min_logit is None else min_logit
        return api.run_compacted(chosen, made, padded, h, w, labels, temperature, ml)

    return head


def xla_head(case: Case):
    """The oracle: ``head_fn`` of the XLA path with several chunks on each axis."""
    return head_fn("xla", case, jaxhead.XlaConfig(token_chunk=64, vocab_chunk=384))


def results(head, h, w, labels, temperature, g, e):
    """``(logp, entropy, dh, dw)`` of ``head`` for the loss ``sum(g logp + e entropy)``,
    under ``jit`` (one compile instead of eager dispatch of every op)."""

    @jax.jit
    def run(h, w, labels, temperature, g, e):
        def loss(h, w):
            logp, ent = head(h, w, labels, temperature)
            return jnp.sum(g * logp) + jnp.sum(e * ent), (logp, ent)

        (_, (logp, ent)), (dh, dw) = jax.value_and_grad(loss, (0, 1), has_aux=True)(h, w)
        return logp, ent, dh, dw

    return run(h, w, labels, temperature, g, e)


@functools.cache
def oracle_results(case: Case):
    """``results`` of the XLA path on ``inputs(case)``, computed once per process (both
    kernels' tests share it)."""
    return results(xla_head(case), *inputs(case))


# Shared by both kernels' tests: several tiles on each axis with the tiles the tests pass
# (T = 32, C = 256: 3 token tiles, 4 vocab tiles for V = 1000 with a partial last one, 8
# for V = 2048), ragged V, ragged N, bf16 and float32, soft-cap, per-token and scalar
# temperature, and the no-entropy variant.
CASES = (
    Case(96, 1000, "float32", softcap=5.0),
    Case(90, 2048, "bfloat16", token_temp=False),
    Case(77, 1000, "bfloat16", softcap=5.0, with_entropy=False),
    Case(96, 2048, "float32", token_temp=False, seed=3),
)


def max_errors(got, want) -> dict[str, float]:
    """Max absolute difference per quantity, computed in float32."""
    names = ("logp", "entropy", "dh", "dw")
    return {
        name: float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))))
        for name, a, b in zip(names, got, want)
    }


def assert_matches(got, want, dtype) -> None:
    """``got`` equals ``want`` within the tolerance of ``dtype``, with the same dtypes and
    shapes, everything finite."""
    tol = TOL[jnp.dtype(dtype)]
    chex.assert_trees_all_equal_shapes_and_dtypes(got, want)
    chex.assert_tree_all_finite(got)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x.astype(jnp.float32), got),
        jax.tree.map(lambda x: x.astype(jnp.float32), want),
        atol=tol, rtol=0.0,
    )


def batch(dtype, seed: int = 7):
    """A ``[2, 40]`` batch for ``jaxhead.token_logprobs``: ``(hidden, weight, labels, keep,
    temperature, adv)`` with V = 1000, ~60% of tokens kept, per-token temperatures."""
    k = jax.random.split(jax.random.key(seed), 6)
    dtype = jnp.dtype(dtype)
    hidden = jax.random.normal(k[0], (2, 40, HIDDEN), jnp.float32).astype(dtype)
    weight = (0.3 * jax.random.normal(k[1], (HIDDEN, 1000), jnp.float32)).astype(dtype)
    labels = jax.random.randint(k[2], (2, 40), 0, 1000)
    keep = jax.random.bernoulli(k[3], 0.6, (2, 40))
    temp = jax.random.uniform(k[4], (2, 40), jnp.float32, 0.5, 2.0)
    adv = jax.random.normal(k[5], (2, 40), jnp.float32) / 80
    return hidden, weight, labels, keep, temp, adv


def token_logprobs_results(impl: str, data, **kw):
    """``(logprobs, entropy, d hidden, d weight)`` of ``jaxhead.token_logprobs`` with a
    keep mask, soft-cap 5 and per-token temperature, for an RL-like loss. The mask stays a
    concrete constant under ``jit``, so the bucket is chosen from the kept count."""
    hidden, weight, labels, keep, temp, adv = data

    @jax.jit
    def run(hidden, weight):
        def loss(hidden, weight):
            out = jaxhead.token_logprobs(
                hidden, weight, labels, keep, temperature=temp, softcap=5.0, impl=impl, **kw
            )
            return jnp.sum(adv * out.logprobs) + 0.1 * jnp.sum(adv * out.entropy), out

        (_, out), grads = jax.value_and_grad(loss, (0, 1), has_aux=True)(hidden, weight)
        return (out.logprobs, out.entropy, *grads)

    return run(hidden, weight)


def assert_token_logprobs_match(impl: str, dtype, config) -> None:
    """``impl`` (in interpret mode) equals the XLA path on ``batch(dtype)``, and skipped
    tokens get exactly zero log-prob and gradient."""
    data = batch(dtype)
    with jaxhead.pallas_interpret():
        got = token_logprobs_results(impl, data, config=config)
    want = token_logprobs_results("xla", data,
                                  config=jaxhead.XlaConfig(token_chunk=16, vocab_chunk=384))
    assert_matches(got, want, dtype)
    skipped = ~np.asarray(data[3])
    assert np.all(np.asarray(got[0])[skipped] == 0.0)
    assert np.all(np.asarray(got[1])[skipped] == 0.0)
    assert np.all(np.asarray(got[2], np.float32)[skipped] == 0.0)
