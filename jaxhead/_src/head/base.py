"""What every implementation of the head shares: the problem it is asked to solve
(``HeadSpec``), the interface it satisfies (``HeadImplementation``), and the custom-VJP
scaffold the chunked implementations are built on (``differentiable``).

An implementation works on *compacted* rows: ``h [B, H]`` (padding rows zero),
``w [H, V_local]`` or, with ``spec.weight_layout == "vh"``, ``w [V_local, H]`` (used as it
is: ``jaxhead._src.head.layout``), ``labels`` int32 ``[B]``, ``temperature`` float32
``[B]`` (> 0; 1.0 on padding rows; the implementation forms the tile math's
``1 / temperature`` itself),
``min_logit`` float32 ``[B]`` (read only when ``spec.truncated``); ``B`` is the padded row
count its ``plan`` returned. It returns float32 ``(logp, entropy)`` ``[B]``,
differentiable with respect to ``h`` and ``w`` (``dw`` in ``w``'s layout).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from jaxhead._src.head import layout
from jaxhead._src.head import math as hm


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """The static problem of one call.

    Attributes:
      rows: kept rows to compute (before padding to the implementation's tile).
      hidden_size: ``H``.
      vocab_size: ``V``: labels index ``[0, V)`` (the whole vocabulary, also when it is
        split over ``vocab_axis``).
      dtype: dtype name of ``h`` and ``w``.
      softcap: soft-cap ``c`` or None.
      with_entropy: compute the entropy (and take its cotangent).
      vocab_axis: mesh axis the vocabulary is split over (inside ``shard_map``), or None.
      vocab_shards: devices of ``vocab_axis``: ``w`` holds ``V / vocab_shards`` columns.
      truncated: each row's distribution is restricted to ``{v : l_v >= min_logit}`` (and
        its label); the implementation reads the ``min_logit`` row input.
      weight_layout: ``"hv"`` (``w [H, V]``) or ``"vh"`` (``w [V, H]``).
      hidden_axes: mesh axes (manual, inside ``shard_map``) the weight's hidden dimension
        is split over (FSDP's layout): ``w`` holds ``H / hidden_shards`` of it, and each
        vocab chunk is all-gathered over them where it is used (``()``: ``w`` whole).
      hidden_shards: devices of ``hidden_axes``.
    """

    rows: int
    hidden_size: int
    vocab_size: int
    dtype: str
    softcap: float | None
    with_entropy: bool
    vocab_axis: str | None = None
    vocab_shards: int = 1
    truncated: bool = False
    weight_layout: str = "hv"
    hidden_axes: tuple[str, ...] = ()
    hidden_shards: int = 1

    @property
    def local_vocab(self) -> int:
        """Vocabulary entries of ``w`` on one device."""
        return self.vocab_size // self.vocab_shards

    @property
    def local_weight_shape(self) -> tuple[int, int]:
        """The shape of ``w`` on one device, in ``weight_layout``."""
        return layout.shape(self.hidden_size // self.hidden_shards, self.local_vocab,
                            self.weight_layout)


class HeadImplementation(Protocol):
    """One implementation of the head (an entry of ``jaxhead._src.head.api.IMPLEMENTATIONS``).

    Attributes:
      config_type: the dataclass of its settings (``token_logprobs(config=...)``).
    """

    config_type: type

    def plan(self, config: Any, spec: HeadSpec) -> tuple[Hashable, int]:
        """``(plan, padded rows)`` for ``spec`` with ``config`` (None: the defaults).

        Raises:
          jaxhead.KernelUnsupported: this implementation cannot run ``spec`` here.
          ValueError / TypeError: a bad ``config`` (the offending value named).
        """

    def __call__(self, plan: Hashable, h: jax.Array, w: jax.Array, labels: jax.Array,
                 temperature: jax.Array, min_logit: jax.Array) -> tuple[jax.Array, jax.Array]:
        """float32 ``(logp, entropy)`` ``[B]`` of the compacted rows."""


@dataclasses.dataclass(frozen=True)
class Implementation:
    """A ``HeadImplementation`` from its parts.

    Attributes:
      config_type: the settings dataclass.
      make_plan: ``(config or None, spec) -> (plan, padded rows)``.
      head: ``(plan, h, w, labels, temperature, min_logit) -> (logp, entropy)``.
    """

    config_type: type
    make_plan: Callable[[Any, HeadSpec], tuple[Hashable, int]]
    head: Callable[..., tuple[jax.Array, jax.Array]]

    def plan(self, config, spec: HeadSpec) -> tuple[Hashable, int]:
        return self.make_plan(config, spec)

    def __call__(self, plan, h, w, labels, temperature, min_logit):
        return self.head(plan, h, w, labels, temperature, min_logit)


Forward = Callable[..., hm.Rows]
Backward = Callable[..., tuple[jax.Array, jax.Array]]


def differentiable(forward: Forward, backward: Backward):
    """A head function ``(plan, h, w, labels, temperature, min_logit) -> (logp, entropy)`` from
    a ``forward(plan, h, w, labels, temperature, min_logit) -> math.Rows`` and a
    ``backward(plan, h, w, labels, temperature, min_logit, m, log_s, entropy, g, e) ->
    (dh, dw)`` that recomputes the logit tiles. The plan must have a ``spec``
    (``HeadSpec``).

    What it adds, once for every implementation: the ``custom_vjp`` (residuals: the inputs
    and three float32 ``[B]`` vectors, nothing vocabulary-sized but ``w``), the label rule
    (``logp = NaN`` where a label is outside ``[0, V)``, never a silently wrong number), the
    dtypes (int32 labels; float32 ``temperature`` and ``min_logit``, which get no
    cotangent: they are data, not parameters, stopped once where the rows are made,
    ``api.row_inputs``).
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def head(plan, h, w, labels, temperature, min_logit):
        return head_fwd(plan, h, w, labels, temperature, min_logit)[0]

    def head_fwd(plan, h, w, labels, temperature, min_logit):
        rows = forward(plan, h, w, labels, temperature, min_logit)
        ok = (labels >= 0) & (labels < plan.spec.vocab_size)
        logp = jnp.where(ok, rows.logp, jnp.nan)
        return (logp, rows.entropy), (h, w, labels, temperature, min_logit, rows.m, rows.log_s,
                                      rows.entropy)

    def head_bwd(plan, res, cts):
        g, e = cts
        dh, dw = backward(plan, *res, g.astype(jnp.float32), e.astype(jnp.float32))
        return dh, dw, None, None, None

    head.defvjp(head_fwd, head_bwd)

    def call(plan, h, w, labels, temperature, min_logit):
        return head(plan, h, w, labels.astype(jnp.int32),
                    temperature.astype(jnp.float32), min_logit.astype(jnp.float32))

    return call
