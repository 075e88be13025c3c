"""The plain full-logits head: the test oracle, the benchmark baseline, and
``impl="reference"``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxhead._src.head import invalid, layout, validation
from jaxhead._src.head import scan as sc
from jaxhead._src.head.base import HeadSpec, Implementation
from jaxhead._src.head.layout import WeightLayout
from jaxhead._src.types import HeadOutput


def reference_token_logprobs(
    hidden: jax.Array,
    weight: jax.Array,
    labels: jax.Array,
    keep: jax.Array | None = None,
    *,
    temperature=1.0,
    softcap: float | None = None,
    with_entropy: bool = True,
    min_logit=None,
    ignore_index: int | None = -100,
    weight_layout: WeightLayout = "hv",
) -> HeadOutput:
    """Log-probs and entropy from the full ``[..., V]`` logits (what plain JAX code does).

    Logits are ``hidden @ weight`` accumulated in float32 (float64 when the inputs are
    float64, for the oracle), soft-capped (``c * tanh(u / c)``), divided by the
    temperature, restricted to ``{l >= min_logit}`` and the label when ``min_logit`` is
    given, then ``log_softmax``. Same contract as ``jaxhead.token_logprobs`` (skipped
    positions give 0 with zero gradient), but it holds the whole ``[N, V]`` logits and
    their gradient: memory O(N V).

    Args:
      hidden: ``[..., H]``; weight: ``[H, V]`` (``weight_layout="hv"``) or ``[V, H]``
        (``"vh"``, e.g. a tied embedding table, used as it is; its gradient is ``[V, H]``
        too); labels: int ``[...]``; keep: bool ``[...]``.
      temperature: scalar or ``[...]``, > 0. softcap: float > 0 or None.
      with_entropy: also return the entropy.
      min_logit: None, or a float scalar / ``[...]`` threshold on the tempered logits (as
        ``jaxhead.token_logprobs``).
      ignore_index: with ``keep=None``, positions whose label equals it are skipped (as
        ``jaxhead.token_logprobs``); None: every position is kept.

    Returns:
      ``HeadOutput`` with float32 (float64 for float64 inputs) ``[...]`` arrays.

    Raises:
      ValueError / TypeError: as ``jaxhead.token_logprobs``.
    """
    validation.check_inputs(hidden, weight, labels, keep, temperature, softcap, min_logit,
                            weight_layout)
    if keep is None and ignore_index is not None:
        keep = jnp.asarray(labels) != ignore_index
        labels = jnp.where(keep, labels, 0)
    validation.check_values(labels, keep, temperature,
                            layout.sizes(weight.shape, weight_layout)[1])
    dtype = jnp.promote_types(jnp.float32, hidden.dtype)
    # under jit: an invalid kept label makes both gradients NaN too, as in token_logprobs
    n = max(labels.size, 1)
    hidden, weight = invalid.nan_gradients_if(invalid.invalid_kept(
        labels, keep, layout.sizes(weight.shape, weight_layout)[1], n), hidden, weight)
    if keep is not None:
        hidden = jnp.where(keep[..., None], hidden, jnp.zeros((), hidden.dtype))
    u = jnp.einsum(  # contracts H in either layout: no transpose of the weight
        "...h,hv->...v" if weight_layout == "hv" else "...h,vh->...v", hidden, weight,
        preferred_element_type=dtype, precision=jax.lax.Precision.HIGHEST,
    )
    z = u if softcap is None else softcap * jnp.tanh(u / softcap)
    temperature = jax.lax.stop_gradient(jnp.asarray(temperature, dtype))
    z = z * (1.0 / (temperature[..., None] if temperature.ndim else temperature))
    if min_logit is not None:  # the truncated support, the label always in
        hit = jnp.arange(z.shape[-1]) == labels[..., None]
        inside = (z >= jnp.asarray(min_logit, dtype)[..., None]) | hit
        z = jnp.where(inside, z, -jnp.inf)
    logp_all = jax.nn.log_softmax(z, axis=-1)
    logp = jnp.take_along_axis(logp_all, labels[..., None].astype(jnp.int32), axis=-1)[..., 0]
    logp = jnp.where((labels >= 0) & (labels < z.shape[-1]), logp, jnp.nan)  # the label rule
    p = jnp.exp(logp_all)  # 0 log 0 = 0, with a zero (not NaN) gradient
    plogp = jnp.where(p > 0, p * jnp.where(p > 0, logp_all, 0.0), 0.0)
    ent = -jnp.sum(plogp, axis=-1) if with_entropy else None
    if keep is not None:
        logp = jnp.where(keep, logp, 0.0)
        ent = None if ent is None else jnp.where(keep, ent, 0.0)
    return HeadOutput(logp, ent)


@dataclasses.dataclass(frozen=True)
class ReferenceConfig:
    """``impl="reference"`` has no settings."""


@dataclasses.dataclass(frozen=True)
class _Plan:
    spec: HeadSpec


def _rows_head(plan: _Plan, h, w, labels, temperature, min_logit):
    """Full float32 logits of the compacted rows, plain autodiff (a weight split over
    ``hidden_axes`` all-gathered whole first)."""
    w = sc.gather_hidden(plan.spec.hidden_axes, 1 - layout.vocab_dim(plan.spec.weight_layout)
                         )(w) if plan.spec.hidden_shards > 1 else w
    out = reference_token_logprobs(h, w, labels, temperature=temperature,
                                   softcap=plan.spec.softcap, with_entropy=plan.spec.with_entropy,
                                   min_logit=min_logit if plan.spec.truncated else None,
                                   ignore_index=None, weight_layout=plan.spec.weight_layout)
    ent = out.entropy if out.entropy is not None else jnp.zeros_like(out.logprobs)
    ok = (labels >= 0) & (labels < plan.spec.vocab_size)
    return jnp.where(ok, out.logprobs, jnp.nan), ent


#: ``impl="reference"``: full logits of the compacted rows (memory ``O(bucket * V)``; for
#: checks and as a baseline).
REFERENCE = Implementation(ReferenceConfig, lambda config, spec: (_Plan(spec), spec.rows),
                           _rows_head)
