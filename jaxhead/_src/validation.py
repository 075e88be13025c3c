"""Input checks shared by every implementation of the head.

Shape and dtype checks always run (shapes are static). Value checks (label range, positive
temperature, bucket capacity) run only on concrete inputs: under ``jit`` the values are not
known on the host, and the head marks the affected outputs with NaN instead (see
``jaxhead.token_logprobs``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def is_concrete(x) -> bool:
    """True when ``x`` holds host-readable values (not a tracer inside a transformation)."""
    return not isinstance(x, jax.core.Tracer)


def check_inputs(hidden, weight, labels, keep, temperature, softcap, min_logit=None) -> None:
    """Raise on shape and dtype errors, naming both shapes or dtypes.

    Raises:
      ValueError: shapes that do not agree, or ``softcap <= 0``.
      TypeError: non-float hidden/weight, differing hidden/weight dtypes, non-integer
        labels, non-bool keep, non-float min_logit.
    """
    hs, ws, ls = jnp.shape(hidden), jnp.shape(weight), jnp.shape(labels)
    if len(hs) < 1:
        raise ValueError(f"hidden must be [..., H], got shape {hs}")
    if len(ws) != 2:
        raise ValueError(f"weight must be [H, V], got shape {ws}")
    if ws[0] != hs[-1]:
        if ws[1] == hs[-1]:
            raise ValueError(
                f"weight has shape {ws}, which looks like [V, H] (the embedding layout): the "
                f"head takes [H, V] = ({hs[-1]}, {ws[0]}); pass weight.T (for a tied "
                f"embedding table, the table transposed)"
            )
        raise ValueError(
            f"hidden shape {hs} and weight shape {ws} disagree on H: {hs[-1]} != {ws[0]}"
        )
    if ls != hs[:-1]:
        raise ValueError(f"labels shape {ls} must equal hidden shape {hs} without its last axis")
    hd, wd = jnp.result_type(hidden), jnp.result_type(weight)
    if not jnp.issubdtype(hd, jnp.floating) or not jnp.issubdtype(wd, jnp.floating):
        raise TypeError(f"hidden and weight must be floating, got {hd} and {wd}")
    if hd != wd:
        raise TypeError(
            f"hidden dtype {hd} != weight dtype {wd}; cast one, e.g. weight.astype(hidden.dtype)"
        )
    if not jnp.issubdtype(jnp.result_type(labels), jnp.integer):
        raise TypeError(f"labels must be integer, got {jnp.result_type(labels)}")
    if keep is not None:
        if jnp.shape(keep) != ls:
            raise ValueError(f"keep shape {jnp.shape(keep)} != labels shape {ls}")
        if jnp.result_type(keep) != jnp.bool_:
            raise TypeError(f"keep must be bool, got {jnp.result_type(keep)}")
    for name, value in (("temperature", temperature), ("min_logit", min_logit)):
        shape = None if value is None else jnp.shape(value)
        if value is not None and shape not in ((), ls):
            raise ValueError(f"{name} must be a scalar or of labels shape {ls}, got shape {shape}")
    if min_logit is not None and not jnp.issubdtype(jnp.result_type(min_logit), jnp.floating):
        raise TypeError(f"min_logit must be floating, got {jnp.result_type(min_logit)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")


def _first_position(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), bad.shape))


def check_values(labels, keep, temperature, vocab_size: int) -> None:
    """Value checks on concrete inputs (skipped for tracers).

    Raises:
      ValueError: a kept label outside ``[0, vocab_size)`` (count and first position named),
        or a temperature that is not > 0 on a kept token.
    """
    if not (is_concrete(labels) and (keep is None or is_concrete(keep))):
        return
    y = np.asarray(labels)
    k = np.ones(y.shape, bool) if keep is None else np.asarray(keep)
    bad = k & ((y < 0) | (y >= vocab_size))
    if bad.any():
        pos = _first_position(bad)
        raise ValueError(
            f"{int(bad.sum())} kept label(s) outside [0, {vocab_size}); first at position "
            f"{pos} with value {int(y[pos])}"
        )
    if is_concrete(temperature):
        t = np.broadcast_to(np.asarray(temperature, np.float64), y.shape)
        bad = k & ~(t > 0)
        if bad.any():
            pos = _first_position(bad)
            raise ValueError(
                f"{int(bad.sum())} kept temperature(s) not > 0; first at position {pos} "
                f"with value {float(t[pos])}"
            )
