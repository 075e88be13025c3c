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

from jaxhead._src.head import layout
from jaxhead._src.scalars import short, static_int


def is_concrete(x) -> bool:
    """True when ``x`` holds host-readable values (not a tracer inside a transformation)."""
    return not isinstance(x, jax.core.Tracer)


def static_bucket(bucket) -> int | None:
    """A head's ``bucket``: None, or any integer scalar >= 0 as an int (``static_int``)."""
    return None if bucket is None else static_int(bucket, "bucket")


def dtype_of(x, name: str):
    """The dtype of the array ``x``.

    Raises:
      TypeError: ``x`` is no array (e.g. a Python list of labels), named briefly.
    """
    try:
        return jnp.result_type(x)
    except TypeError:
        raise TypeError(f"{name} must be an array (numpy or jax), got {short(x)}") from None


def check_weight(hidden_shape, weight_shape, weight_layout, hidden_shards: int = 1) -> None:
    """Raise unless ``weight_layout`` is ``"hv"`` / ``"vh"`` and a weight of ``weight_shape``
    in it has the hidden size of ``hidden_shape [..., H]`` (``H / hidden_shards`` of it:
    a device's part of a weight split over ``hidden_shards`` devices).

    Raises:
      ValueError: another layout (named); a weight that is not 2-D, or whose hidden
        dimension is not ``H`` (the shape, the layout and, when the other layout fits, that
        one named).
    """
    layout.check(weight_layout)
    hs, ws = tuple(hidden_shape), tuple(weight_shape)
    if len(hs) < 1:
        raise ValueError(f"hidden must be [..., H], got shape {hs}")
    names = {"hv": "[H, V]", "vh": "[V, H]"}
    if len(ws) != 2:
        raise ValueError(f"weight must be {names[weight_layout]} with "
                         f"weight_layout={weight_layout!r}, got shape {ws}")
    if hidden_shards > 1:
        if hs[-1] % hidden_shards or layout.sizes(ws, weight_layout)[0] * hidden_shards != hs[-1]:
            raise ValueError(
                f"weight {list(ws)} with weight_layout={weight_layout!r} split over "
                f"{hidden_shards} devices along its hidden dimension does not match hidden "
                f"size {hs[-1]} (hidden shape {hs}): each device must hold H / "
                f"{hidden_shards} = {hs[-1] / hidden_shards:g} of its hidden dimension")
        return
    if layout.sizes(ws, weight_layout)[0] != hs[-1]:
        other = "vh" if weight_layout == "hv" else "hv"
        what = "weight (e.g. a tied embedding table)" if other == "vh" else "weight"
        hint = (f"; a {names[other]} {what} needs weight_layout={other!r}"
                if layout.sizes(ws, other)[0] == hs[-1] else "")
        raise ValueError(
            f"weight {list(ws)} with weight_layout={weight_layout!r} does not match hidden "
            f"size {hs[-1]} (hidden shape {hs}){hint}")


def check_inputs(hidden, weight, labels, keep, temperature, softcap, min_logit=None,
                 weight_layout="hv", hidden_shards: int = 1) -> None:
    """Raise on shape and dtype errors, naming both shapes or dtypes.

    Raises:
      ValueError: shapes that do not agree (``check_weight``), an unknown
        ``weight_layout``, or ``softcap <= 0``.
      TypeError: non-float hidden/weight, differing hidden/weight dtypes, non-integer
        labels, non-bool keep, non-float min_logit.
    """
    hd, wd = dtype_of(hidden, "hidden"), dtype_of(weight, "weight")
    labels_dtype = dtype_of(labels, "labels")
    hs, ls = jnp.shape(hidden), jnp.shape(labels)
    check_weight(hs, jnp.shape(weight), weight_layout, hidden_shards)
    if ls != hs[:-1]:
        raise ValueError(f"labels shape {ls} must equal hidden shape {hs} without its last axis")
    check_float_pair(hd, wd)
    if not jnp.issubdtype(labels_dtype, jnp.integer):
        raise TypeError(f"labels must be integer, got {labels_dtype}")
    if keep is not None:
        if dtype_of(keep, "keep") != jnp.bool_:
            raise TypeError(f"keep must be bool, got {jnp.result_type(keep)}")
        if jnp.shape(keep) != ls:
            raise ValueError(f"keep shape {jnp.shape(keep)} != labels shape {ls}")
    for name, value in (("temperature", temperature), ("min_logit", min_logit)):
        shape = None if value is None else jnp.shape(value)
        if value is not None and shape not in ((), ls):
            raise ValueError(f"{name} must be a scalar or of labels shape {ls}, got shape {shape}")
    if min_logit is not None and not jnp.issubdtype(jnp.result_type(min_logit), jnp.floating):
        raise TypeError(f"min_logit must be floating, got {jnp.result_type(min_logit)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")


def check_float_pair(hd, wd) -> None:
    """Raise unless the dtypes of hidden and weight are the same floating dtype.

    Raises:
      TypeError: either is not floating, or they differ (both named).
    """
    if not jnp.issubdtype(hd, jnp.floating) or not jnp.issubdtype(wd, jnp.floating):
        raise TypeError(f"hidden and weight must be floating, got {hd} and {wd}")
    if hd != wd:
        raise TypeError(
            f"hidden dtype {hd} != weight dtype {wd}; cast one, e.g. weight.astype(hidden.dtype)"
        )


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


def hidden_shards(axes) -> tuple[tuple[str, ...], int]:
    """``(axes, devices)`` of ``token_logprobs(weight_hidden_axes=axes)``: the mesh axes as
    a tuple of names and the product of their sizes (``jax.lax.axis_size``); ``((), 1)``
    when that product is 1 (nothing is split).

    Raises:
      ValueError: an axis that is not a manual axis of an enclosing ``jax.shard_map``, or
        one named twice (named).
    """
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    if len(set(axes)) != len(axes):
        raise ValueError(f"weight_hidden_axes={axes!r} names an axis twice")
    n = 1
    for a in axes:
        try:
            n *= jax.lax.axis_size(a)
        except (NameError, KeyError, ValueError, TypeError) as e:
            raise ValueError(
                f"weight_hidden_axes={axes!r}: {a!r} is not a manual mesh axis here; the "
                f"hidden-split weight is for use inside jax.shard_map over those axes ({e})"
            ) from None
    return (axes, n) if n > 1 else ((), 1)
