"""The two layouts of the head weight, and the three matmuls of the head in each.

``"hv"``: ``w [H, V]`` (a ``Linear`` kernel); ``"vh"``: ``w [V, H]`` (an embedding table,
tied to the head and used in place). Every implementation takes ``w`` in the layout of
``HeadSpec.weight_layout``, slices vocab chunks along ``vocab_dim``, and contracts the
hidden dimension with ``lax.dot_general`` dimension numbers: the whole weight is never
transposed, and ``dw`` comes back in the layout ``w`` came in. Tiles of a ``"vh"`` weight
are ``[C, H]``; their ``dw`` tiles are ``[C, H]`` too.
"""

from __future__ import annotations

from typing import Literal, get_args

import jax

from jaxhead._src.head import math as hm

#: ``"hv"``: ``[H, V]``; ``"vh"``: ``[V, H]``.
WeightLayout = Literal["hv", "vh"]
LAYOUTS: tuple[str, ...] = get_args(WeightLayout)


def check(weight_layout) -> None:
    """Raises:
      ValueError: ``weight_layout`` is not ``"hv"`` or ``"vh"`` (the value named)."""
    if not isinstance(weight_layout, str) or weight_layout not in LAYOUTS:
        raise ValueError(
            f"weight_layout must be 'hv' ([H, V]) or 'vh' ([V, H], e.g. a tied embedding "
            f"table), got {weight_layout!r}")


def vocab_dim(weight_layout: str) -> int:
    """The dimension of ``w`` that indexes the vocabulary: 1 (``"hv"``) or 0 (``"vh"``)."""
    return 1 if weight_layout == "hv" else 0


def sizes(shape, weight_layout: str) -> tuple[int, int]:
    """``(H, V)`` of a weight of ``shape`` in ``weight_layout``."""
    return (shape[0], shape[1]) if weight_layout == "hv" else (shape[1], shape[0])


def shape(hidden_size: int, vocab_size: int, weight_layout: str) -> tuple[int, int]:
    """The shape of an ``H x V`` weight in ``weight_layout``."""
    return (hidden_size, vocab_size) if weight_layout == "hv" else (vocab_size, hidden_size)


def logits(h: jax.Array, w: jax.Array, weight_layout: str) -> jax.Array:
    """float32 ``u = h w`` ``[T, C]`` of ``h [T, H]`` and a tile ``w`` (``[H, C]`` or
    ``[C, H]``)."""
    return hm.matmul(h, w, (1, 1 - vocab_dim(weight_layout)))


def dhidden(du: jax.Array, w: jax.Array, weight_layout: str) -> jax.Array:
    """float32 ``du w^T`` ``[T, H]`` of ``du [T, C]`` and the tile ``w``."""
    return hm.matmul(du, w, (1, vocab_dim(weight_layout)))


def dweight(h: jax.Array, du: jax.Array, weight_layout: str) -> jax.Array:
    """float32 ``dw`` tile of ``h [T, H]`` and ``du [T, C]`` in the weight's layout:
    ``h^T du`` ``[H, C]`` (``"hv"``) or ``du^T h`` ``[C, H]`` (``"vh"``)."""
    return hm.matmul(h, du, (0, 0)) if weight_layout == "hv" else hm.matmul(du, h, (0, 0))
