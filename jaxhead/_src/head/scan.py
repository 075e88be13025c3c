"""Loop primitives of the chunked XLA head and the sampler: scans over row chunks and vocab
chunks whose bodies read large loop-invariant operands.

``Tuning`` is the hook a backend-specific implementation overrides (``xla_cpu``); the
neutral one here adds nothing, so the backend-neutral path is plain ``lax.scan``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxhead._src.head import layout


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Backend tuning of the XLA head: the neutral choice (hashable; part of a plan).

    Subclasses override the hooks; see ``jaxhead._src.head.xla_cpu.CpuTuning``.
    """

    #: carry the loop-invariant operands through each scan behind an
    #: ``optimization_barrier`` (so the compiler cannot hoist whole-array work out of it)
    pin_operands: bool = False

    def tile_dtype(self, dtype) -> jnp.dtype:
        """Operand dtype of the tile matmuls for inputs of ``dtype`` (accumulation is
        always float32)."""
        return jnp.dtype(dtype)

    def dw_tile(self, h_t: jax.Array, du: jax.Array, weight_layout: str) -> jax.Array:
        """float32 ``dw`` term of one token tile, of ``dw_chunk_shape``: here in the
        weight's layout, ``h_t^T @ du`` ``[H, C]`` or ``du^T @ h_t`` ``[C, H]``."""
        return layout.dweight(h_t, du, weight_layout)

    def dw_chunk_shape(self, shape, weight_layout: str) -> tuple[int, ...]:
        """Shape of the float32 accumulator of one vocab chunk's ``dw`` whose weight tile
        has ``shape`` (here the same: ``dw_buffer`` writes it as it is)."""
        return shape

    def dw_hidden_dim(self, weight_layout: str) -> int:
        """The hidden dimension of a ``dw_chunk_shape`` chunk (here the weight's)."""
        return 1 - layout.vocab_dim(weight_layout)

    def dw_buffer(self, w: jax.Array, weight_layout: str) -> DwBuffer:
        """Where the ``dw`` chunks (``w``'s shape and layout) are written."""
        return DwBuffer(w, layout.vocab_dim(weight_layout))


class DwBuffer:
    """The ``dw`` output written one vocab chunk at a time (plain dynamic-update-slices
    along the vocab dimension ``axis``)."""

    def __init__(self, w, axis: int):
        self.dtype, self.axis = w.dtype, axis
        self.init = jnp.zeros(w.shape, w.dtype)

    def write(self, dw, dw_c, off):
        return lax.dynamic_update_slice_in_dim(dw, dw_c.astype(self.dtype), off, self.axis)

    def finish(self, dw):
        return dw


def vary_like(carry, refs):
    """``carry`` made to vary over every mesh axis that an array of ``refs`` varies over.

    Inside ``jax.shard_map`` a scan carry must keep its type, but an initial value such as
    ``jnp.zeros(...)`` is invariant while the body mixes in per-shard inputs. Adding a
    zero scalar derived from every ref (``zeros_like`` keeps the varying axes) fixes the
    type with public ops only; outside ``shard_map`` (or when nothing varies) the added
    zeros are constants that XLA folds away.
    """
    refs = jax.tree.leaves(refs)
    if not refs:
        return carry
    zero = sum(jnp.zeros_like(r, dtype=jnp.float32, shape=()) for r in refs)

    def add(c):
        return c | (zero != 0) if c.dtype == jnp.bool_ else c + zero.astype(c.dtype)

    return jax.tree.map(add, carry)


def scan(tuning: Tuning, body, carry, xs, pinned, vary=()):
    """``lax.scan`` whose ``body(carry, x, *pinned) -> (carry, y)`` also receives the large
    loop-invariant arrays ``pinned`` (the hidden rows, the weight), behind an
    ``optimization_barrier`` when ``tuning.pin_operands``. ``vary``: arrays the body reads
    from its closure (see ``vary_like``; ``xs`` and ``pinned`` are counted already)."""
    carry = vary_like(carry, (xs, pinned, vary))
    if not tuning.pin_operands:
        return lax.scan(lambda c, x: body(c, x, *pinned), carry, xs)

    def step(c, x):
        c, p = c
        p = tuple(lax.optimization_barrier(a) for a in p)  # one each: keeps their types
        c, y = body(c, x, *p)
        return (c, p), y

    (carry, _), ys = lax.scan(step, (carry, pinned), xs)
    return carry, ys


def scan_vocab(tuning: Tuning, chunk: int, step, carry, w, pinned=(), vary=(), axis: int = 1,
               fetch=None):
    """Apply ``carry = step(carry, w_c, offset, *pinned)`` to every vocab chunk ``w_c`` of
    ``w`` (in ``tuning.tile_dtype``), sliced along its vocab dimension ``axis`` (1 for
    ``[H, V]``, 0 for ``[V, H]``). Full chunks run in a scan; a ragged remainder runs once
    more with its own (narrower, static) width, so no padded vocab entry exists.
    ``fetch``: applied to each slice first (None: nothing), e.g. the all-gather of a
    weight whose hidden dimension is split over devices (``gather_hidden``)."""
    dtype = tuning.tile_dtype(w.dtype)
    n_full, tail = divmod(w.shape[axis], chunk)
    fetch = fetch or (lambda w_c: w_c)

    def body(c, i, w, *pinned):
        w_c = fetch(lax.dynamic_slice_in_dim(w, i * chunk, chunk, axis=axis)).astype(dtype)
        return step(c, w_c, i * chunk, *pinned), None

    if n_full:
        carry, _ = scan(tuning, body, carry, jnp.arange(n_full), (w, *pinned), vary)
    if tail:
        w_c = fetch(lax.slice_in_dim(w, n_full * chunk, w.shape[axis], axis=axis)).astype(dtype)
        carry = step(carry, w_c, n_full * chunk, *pinned)
    return carry


def gather_hidden(axes: tuple[str, ...], hidden_dim: int):
    """A ``scan_vocab`` ``fetch``: the chunk all-gathered over the mesh ``axes`` along its
    ``hidden_dim`` (``[H / n, C]`` -> ``[H, C]``, or ``[C, H / n]`` -> ``[C, H]``), or None
    when ``axes`` is empty."""
    if not axes:
        return None
    return lambda w_c: lax.all_gather(w_c, axes, axis=hidden_dim, tiled=True)


def chunks(chunk: int, *xs):
    """``[B, ...]`` arrays as ``[B // chunk, chunk, ...]`` (scan inputs)."""
    return tuple(x.reshape((x.shape[0] // chunk, chunk) + x.shape[1:]) for x in xs)


def rows(x, i, chunk: int, dtype=None):
    """Rows ``[i * chunk, (i + 1) * chunk)`` of ``x``, cast to ``dtype`` if given."""
    out = lax.dynamic_slice_in_dim(x, i * chunk, chunk)
    return out if dtype is None else out.astype(dtype)


def put_rows(out, i, rows_f32):
    """``out`` with rows ``i * T ...`` replaced by ``rows_f32 [T, ...]`` cast to its dtype."""
    chunk = rows_f32.shape[0]
    return lax.dynamic_update_slice_in_dim(out, rows_f32.astype(out.dtype), i * chunk, 0)
