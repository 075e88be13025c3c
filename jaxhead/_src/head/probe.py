"""Whether a kernel's plan lowers for the platform the trace compiles for, before it is used.

``impl="auto"`` must never crash where the XLA path would run: a planning error is caught
where the plan is made (``api.plan``), but a kernel that fails to *lower* (Mosaic or Triton
refusing an op, a block shape, a layout) would only fail when the whole program is lowered,
in the user's ``jit(...).lower()``, too late to choose another implementation. So under
``"auto"`` a compiled (not interpreted) kernel plan is first lowered on its own: the
forward and the backward (``jax.grad`` of ``sum(logp) + sum(entropy)``) of abstract inputs
of the plan's shapes, for the target platform (``jaxhead.dispatch.target_platform``). The answer
is cached per (implementation, plan, rows, platform): one probe per distinct call shape
per process, a few hundred milliseconds each (Mosaic / Triton IR is built, not compiled).

Compile-time failures past lowering (e.g. a kernel exceeding VMEM) are not probed: that
would need the devices; the tile planners budget each generation's VMEM instead.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp

from jaxhead import dispatch
from jaxhead._src.head import pallas_mode
from jaxhead._src.head.base import HeadSpec


def lowering_error(head, plan, padded: int, spec: HeadSpec) -> str | None:
    """None when ``head(plan, ...)`` on ``padded`` rows of ``spec`` lowers (forward and
    backward) for the target platform, else the error as ``"Type: message"`` (first 500
    characters). Interpret-mode plans and empty ones are not probed (None)."""
    if padded == 0 or pallas_mode.interpret_mode() is not None:
        return None
    platform = dispatch.target_platform(pallas_mode.planned_mesh())  # compile_for's too
    return _probe(head, plan, padded, spec, platform)


@functools.lru_cache(maxsize=128)
def _probe(head, plan, padded: int, spec: HeadSpec, platform: str | None) -> str | None:
    dtype = jnp.dtype(spec.dtype)
    vec = jax.ShapeDtypeStruct((padded,), jnp.float32)
    args = (jax.ShapeDtypeStruct((padded, spec.hidden_size), dtype),
            jax.ShapeDtypeStruct(spec.local_weight_shape, dtype),
            jax.ShapeDtypeStruct((padded,), jnp.int32), vec, vec)

    def loss(h, w, labels, temperature, min_logit):
        logp, ent = head(plan, h, w, labels, temperature, min_logit)
        return jnp.sum(logp) + jnp.sum(ent)

    with _one_device():
        return dispatch.lowering_error(jax.grad(loss, (0, 1)), *args, platform=platform)


#: The private jax names this module uses, the only ``jax._src`` import of the packages
#: (``tests/train/test_layout.py`` pins both: that no other module imports ``jax._src``,
#: and that these exist in the jax installed).
PRIVATE_JAX = (("jax._src.sharding_impls", "_internal_use_concrete_mesh"),
               ("jax._src.mesh", "empty_concrete_mesh"))


@contextlib.contextmanager
def _one_device():
    """No mesh in context: the probe lowers for one device, as the kernel runs (the caller
    checked that nothing would partition it: ``pallas_mode.check_runnable``). Clearing the
    concrete mesh of ``jax.set_mesh`` inside a trace has no public API in jax 0.10; without
    the private one the probe runs under that mesh (and may wrongly refuse the kernel)."""
    from jax._src import mesh as mesh_lib
    from jax._src import sharding_impls

    use_concrete = getattr(sharding_impls, "_internal_use_concrete_mesh", None)
    empty = getattr(mesh_lib, "empty_concrete_mesh", None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())))
        if use_concrete is not None and empty is not None:
            stack.enter_context(use_concrete(empty))
        yield
