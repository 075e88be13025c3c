"""What the two fused kernels (``pallas_tpu``, ``pallas_gpu``) share: the packing
precondition and the tile-size rule.

Both kernels mask causally **by index** within a row and by segment-id equality; the
model masks by **position** (``models.attention.reference.attention_mask``). The two agree
when, within every non-zero segment of a row, positions strictly increase with the index
(e.g. contiguous segments whose positions restart at 0 and grow by 1: what the trainer's
packing and ``Transformer`` prefill produce). ``check_packing`` asserts it on concrete
inputs; under ``jit`` the inputs are traced and the precondition is the caller's.
Padding (segment id 0) reads earlier padding in the kernels (finite, read by no loss)
instead of nothing as in the XLA paths; real tokens never read padding in either.

Shapes not supported by a kernel raise ``KernelUnsupported`` (``block_size``;
``models.attention.api`` falls back to the XLA path under ``impl="auto"`` and logs it).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxhead.dispatch import KernelUnsupported


def check_packing(positions: jax.Array, segment_ids: jax.Array) -> None:
    """Raise ``ValueError`` unless positions strictly increase with the index within each
    non-zero segment of each row (then causal-by-index within a segment equals
    causal-by-position). No-op on traced inputs.

    Args:
      positions, segment_ids: int ``[B, T]``.
    """
    try:
        pos, seg = np.asarray(positions), np.asarray(segment_ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    for row, (p, s) in enumerate(zip(pos, seg)):
        order = np.lexsort((np.arange(len(s)), s))  # by segment, then index
        p, s = p[order], s[order]
        same = (s[1:] == s[:-1]) & (s[1:] != 0)
        bad = np.flatnonzero(same & (p[1:] <= p[:-1]))
        if bad.size:
            raise ValueError(
                f"row {row}: positions do not increase within segment {s[bad[0]]} "
                f"(index-causal kernels need them increasing with the index)"
            )


def block_size(length: int, block: int, quantum: int, name: str) -> int:
    """The tile size for ``length`` tokens: ``min(block, length)``.

    Raises:
      KernelUnsupported: ``length`` not a multiple of the tile, or the tile not a
        multiple of ``quantum`` (``name``, the kernel, in the message).
    """
    size = min(block, length)
    if length % size or size % quantum:
        raise KernelUnsupported(
            f"{name} needs the length ({length}) to be a multiple of its block ({size}) "
            f"and the block a multiple of {quantum}"
        )
    return size
