"""Host scalars in arguments and in error messages, below every other module:
``static_int`` (sizes and buckets) and ``short`` (a value named in an error, cut short)."""

from __future__ import annotations

import operator

import jax
import numpy as np


def short(value, limit: int = 60) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters (with the type and
    length of what was cut, e.g. a Python list of labels)."""
    text = repr(value)
    if len(text) <= limit:
        return text
    size = f" of {len(value)} items" if hasattr(value, "__len__") else ""
    return f"{text[:limit]}... ({type(value).__name__}{size})"


def static_int(value, name: str, minimum: int = 0) -> int:
    """``value`` as a Python int: any integer scalar known on the host (``int``,
    ``np.int64``, a 0-d integer array), not a bool, a float or a traced value.

    Raises:
      ValueError: anything else, or an integer below ``minimum`` (the value named).
    """
    n = None
    if not isinstance(value, (bool, np.bool_)):
        try:
            n = operator.index(value)
        except (TypeError, jax.errors.ConcretizationTypeError):
            n = None
    if n is None or n < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} known on the host, got "
                         f"{short(value)}")
    return n
