"""Bucket ladder: the static padded sizes that the compacted kept-token set is rounded up to.

Under ``jit`` every shape is static, but the number of kept tokens changes from step to
step. The host knows that count before the step (the masks are built from host data), so
it rounds it up to the next rung of a fixed ladder and passes the rung as a static
argument: few compiled variants, bounded padding waste.

The ladder with ``multiple=m`` and ``growth=g`` is ``r_0 = m`` and
``r_{k+1} = max(r_k + m, round_up(ceil(g * r_k), m))``, capped by ``max_size`` (which is
always the last rung). With the defaults ``m=128, g=1.25``:

* growth factor between rungs: ``g * r_k`` rounded up to a multiple of ``m`` once
  ``r_k >= m / (g - 1) = 512`` (1.4 at 640 -> 896, tending to 1.25); below that the rungs
  are consecutive multiples of 128;
* worst-case padding waste: a count of ``r_k + 1`` padded to ``r_{k+1}`` wastes
  ``(r_{k+1} - r_k - 1) / r_{k+1} < 1 - 1/g + m / r_{k+1}``. Exactly, on the default ladder:
  49.6% at the first step (129 tokens in 256), 28.5% at 640 -> 896, at most 25% from 896
  up and at most 21.1% from 1536 up (the last step, to ``max_size``, wastes less);
* number of distinct sizes: 19 rungs up to N = 16384, 25 up to 65536, 31 up to 262144
  (``len(bucket_ladder(N))``): each is at most one compiled variant of the step.
"""

from __future__ import annotations

import math

from jaxhead._src.scalars import static_int

DEFAULT_MULTIPLE = 128
DEFAULT_GROWTH = 1.25


def _check_ladder_args(multiple: int, growth: float) -> int:
    multiple = static_int(multiple, "multiple", 1)
    if not growth > 1.0:
        raise ValueError(f"growth must be > 1, got {growth!r}")
    return multiple


def bucket_ladder(
    max_size: int, *, multiple: int = DEFAULT_MULTIPLE, growth: float = DEFAULT_GROWTH
) -> list[int]:
    """All rungs of the ladder up to and including ``max_size``.

    Args:
      max_size: the largest bucket (normally the number of tokens N); always the last rung.
      multiple: every rung below ``max_size`` is a multiple of it (tile alignment).
      growth: ratio between consecutive rungs once they exceed ``multiple / (growth - 1)``.

    Returns:
      Increasing list of ints, ending with ``max_size``.

    Raises:
      ValueError: ``max_size`` / ``multiple`` no integer scalar (``int``, ``np.int64``,
        ...), ``max_size < 0``, ``multiple < 1`` or ``growth <= 1`` (the value named).
    """
    multiple = _check_ladder_args(multiple, growth)
    max_size = static_int(max_size, "max_size")
    rungs = []
    r = multiple
    while r < max_size:
        rungs.append(r)
        nxt = math.ceil(math.ceil(growth * r) / multiple) * multiple
        r = max(r + multiple, nxt)
    rungs.append(max_size)
    return rungs


def bucket_size(
    num_kept: int,
    max_size: int | None = None,
    *,
    multiple: int = DEFAULT_MULTIPLE,
    growth: float = DEFAULT_GROWTH,
) -> int:
    """Smallest ladder rung that holds ``num_kept`` tokens.

    Args:
      num_kept: number of kept tokens (a host int, e.g. ``int(keep.sum())``).
      max_size: total number of tokens N; the result never exceeds it. ``None``: unbounded.
      multiple, growth: the ladder (see the module docstring for waste and rung counts).

    Returns:
      An int ``b`` with ``num_kept <= b``; ``b == max_size`` when the next rung would pass
      it. ``num_kept == 0`` gives the first rung (``min(multiple, max_size)``).

    Raises:
      ValueError: ``num_kept`` / ``max_size`` / ``multiple`` no integer scalar (``int``,
        ``np.int64``, a concrete 0-d array), negative ``num_kept``, or
        ``num_kept > max_size`` (the value named).
    """
    multiple = _check_ladder_args(multiple, growth)
    num_kept = static_int(num_kept, "num_kept")
    max_size = None if max_size is None else static_int(max_size, "max_size")
    if max_size is not None and num_kept > max_size:
        raise ValueError(f"num_kept={num_kept} exceeds max_size={max_size}")
    r = multiple
    while r < num_kept:
        nxt = math.ceil(math.ceil(growth * r) / multiple) * multiple
        r = max(r + multiple, nxt)
    return r if max_size is None else min(r, max_size)
