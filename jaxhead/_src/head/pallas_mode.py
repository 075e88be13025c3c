"""Where the Pallas kernels run: on their accelerator (the one a trace compiles for), or
interpreted on CPU; and the plumbing both kernels share to run inside ``jax.shard_map``.

The platform a trace compiles for (``target_platform``) is the one of the mesh in context
(``jax.set_mesh``, or ``jax.shard_map``'s own), whose abstract device names it, and
otherwise ``jax.default_backend()``: under ``jax.set_mesh`` of a TPU topology's devices
(``jax.experimental.topologies.get_topology_desc``) a CPU-only machine plans, lowers and
compiles the TPU kernels as a TPU would.

The kernels of ``impl="pallas_tpu"`` and ``impl="pallas_triton"`` compile for a TPU or a
GPU. For tests and CPU dry runs they can run in Pallas interpret mode instead, selected
without any new argument on the public API:

* the environment variable ``JAXHEAD_PALLAS_INTERPRET`` (read when a kernel config is made,
  i.e. at trace time), or
* the context manager ``jaxhead.pallas_interpret(mode)``, which takes precedence over the
  variable.

Modes: ``None`` (unset, ``""`` or ``"0"``: compile for the device), ``"interpret"`` (``"1"``:
TPU kernels run in ``pltpu.InterpretParams()``, Triton kernels with ``interpret=True``) and
``"races"`` (TPU kernels run in the TPU interpreter with two simulated cores sharing the
"parallel" grid axis and its race detector on; Triton kernels as ``"interpret"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import jax
from jax import numpy as jnp

from jaxhead._src.head.base import KernelUnsupported

ENV_VAR = "JAXHEAD_PALLAS_INTERPRET"
MODES = (None, "interpret", "races")
_ENV_VALUES = {"": None, "0": None, "1": "interpret", "interpret": "interpret", "races": "races"}
_override: contextvars.ContextVar[tuple[str | None] | None] = contextvars.ContextVar(
    "jaxhead_pallas_interpret", default=None
)


def interpret_mode() -> str | None:
    """The current mode: the innermost ``interpret(...)`` context, else the env variable.

    Raises:
      ValueError: an unknown value of ``JAXHEAD_PALLAS_INTERPRET`` (the valid ones named).
    """
    override = _override.get()
    if override is not None:
        return override[0]
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw not in _ENV_VALUES:
        raise ValueError(f"{ENV_VAR} must be one of {sorted(_ENV_VALUES)}, got {raw!r}")
    return _ENV_VALUES[raw]


@contextlib.contextmanager
def interpret(mode: str | None = "interpret") -> Iterator[None]:
    """Run the kernels traced inside this block in ``mode`` (one of ``MODES``).

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    token = _override.set((mode,))
    try:
        yield
    finally:
        _override.reset(token)


def target_device():
    """The abstract device (``device_kind``, ``num_cores``, ``platform``) of the mesh in
    context, or None (no mesh set, or a mesh without devices)."""
    return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)


def target_platform() -> str:
    """The platform the current trace compiles for: ``"tpu"``, ``"gpu"``, ``"cpu"``, ...;
    the mesh in context decides (see the module docstring), else
    ``jax.default_backend()``."""
    device = target_device()
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


def check_platform(mode: str | None, platform: str, kernel: str) -> None:
    """Raise ``KernelUnsupported`` unless ``kernel`` can run here: interpreted, or compiled
    for ``platform`` (``"tpu"`` or ``"gpu"``, see ``target_platform``)."""
    target = target_platform()
    if mode is None and target != platform:
        raise KernelUnsupported(
            f"{kernel} needs a {platform} backend, the target is {target!r} (the default "
            f"backend, or the devices of the mesh set with jax.set_mesh; set {ENV_VAR}=1 "
            f"to run it in Pallas interpret mode)"
        )


def out_shape(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output of ``shape`` / ``dtype`` that varies over the mesh axes any
    of ``inputs`` varies over: inside ``jax.shard_map`` (``check_vma=True``) a kernel's
    outputs must say so; outside, the set is empty."""
    varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in inputs))
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
