"""Where the Pallas kernels run: on their accelerator (the one a trace compiles for), or
interpreted on CPU; and the plumbing both kernels share to run inside ``jax.shard_map``.

The platform a trace compiles for is ``jaxhead.dispatch.target_platform`` of the mesh the
plans are for (``per_device``, else the mesh in context): under ``jax.set_mesh`` of a TPU
topology's devices (``jax.experimental.topologies.get_topology_desc``) a CPU-only machine
plans, lowers and compiles the TPU kernels as a TPU would.

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
import math
import os
from collections.abc import Iterator

import jax
from jax import numpy as jnp

from jaxhead import dispatch
from jaxhead.dispatch import KernelUnsupported

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


_per_device: contextvars.ContextVar[jax.sharding.Mesh | None] = contextvars.ContextVar(
    "jaxhead_pallas_per_device", default=None)


@contextlib.contextmanager
def per_device(mesh: jax.sharding.Mesh) -> Iterator[None]:
    """Plans made in this block are for one device of a ``jax.shard_map`` over ``mesh``
    (made before entering it): their platform is ``mesh``'s, and no partitioning is left."""
    token = _per_device.set(mesh)
    try:
        yield
    finally:
        _per_device.reset(token)


def target_device():
    """The abstract device (``device_kind``, ``num_cores``, ``platform``) of the mesh the
    plans are for (``per_device``), else of the mesh in context, or None (no mesh set, or a
    mesh without devices)."""
    mesh = _per_device.get()
    mesh = jax.sharding.get_abstract_mesh() if mesh is None else mesh.abstract_mesh
    return getattr(mesh, "abstract_device", None)


@contextlib.contextmanager
def target_mesh() -> Iterator[None]:
    """Make ``per_device``'s mesh the abstract mesh in context while no mesh is (for jax
    helpers that read the device from it, e.g. ``pltpu.get_tpu_info``); else nothing."""
    mesh = _per_device.get()
    if mesh is None or not jax.sharding.get_abstract_mesh().empty:
        yield
        return
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield


def auto_partitioned_devices() -> int:
    """Devices a kernel traced here would be split over by XLA's partitioner: the product
    of the mesh-in-context's axes that are not manual (1 inside a ``jax.shard_map`` over
    every axis, in ``per_device``, or without a mesh)."""
    if _per_device.get() is not None:
        return 1
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    return math.prod(size for size, kind in zip(mesh.axis_sizes, mesh.axis_types)
                     if kind != manual)


def planned_mesh() -> jax.sharding.Mesh | None:
    """The mesh of ``per_device``, or None (the mesh in context decides)."""
    return _per_device.get()


def check_runnable(mode: str | None, platform: str, kernel: str) -> None:
    """Raise ``KernelUnsupported`` unless ``kernel`` can run here: interpreted, or compiled
    for ``platform`` (``"tpu"`` or ``"gpu"``, ``dispatch.target_platform``) on one device each
    (a compiled kernel cannot be split by XLA's partitioner: over a multi-device mesh it
    must run inside ``jax.shard_map``, as ``jaxhead.sharded_token_logprobs`` does)."""
    if mode is not None:
        return
    target = dispatch.target_platform(planned_mesh())
    if target != platform:
        raise KernelUnsupported(
            f"{kernel} needs a {platform} backend, the target is {target!r} (the default "
            f"backend, or the devices of the mesh set with jax.set_mesh; set {ENV_VAR}=1 "
            f"to run it in Pallas interpret mode)"
        )
    split = auto_partitioned_devices()
    if split > 1:
        raise KernelUnsupported(
            f"{kernel}: a compiled kernel cannot be partitioned over the {split} devices of "
            "the mesh in context; call it inside jax.shard_map (jaxhead.sharded_token_"
            "logprobs does)")


def out_shape(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output of ``shape`` / ``dtype`` that varies over the mesh axes any
    of ``inputs`` varies over: inside ``jax.shard_map`` (``check_vma=True``) a kernel's
    outputs must say so; outside, the set is empty."""
    varying = frozenset().union(*(jax.typeof(x).manual_axis_type.varying for x in inputs))
    return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype),
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
