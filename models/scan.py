"""Scanned layers: identical NNX modules stacked on a leading ``"layers"`` axis and applied
with ``jax.lax.scan``, so the compiled program holds one layer body whatever the depth.

The stacked module is an ordinary module of the layer's class whose every parameter has
one more leading axis ``[L, ...]`` (logical axis name ``"layers"``, placed on no mesh
axis). ``scan_layers`` splits it into its graph definition and state and scans over the
state (``jax.lax.scan`` over split state rather than ``nnx.scan``: the body is a pure
function of arrays, so ``jax.checkpoint`` policies apply to it directly and no NNX
transform metadata has to agree with the stacked ``out_sharding`` names).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

#: Logical axis name of the stacked layer axis.
LAYER_AXIS = "layers"

#: ``checkpoint_name`` of a decoder layer's input inside the rematerialised body (what the
#: ``"offload"`` policy moves to host memory).
LAYER_INPUT = "decoder_layer_input"

#: ``remat_policy`` name -> ``jax.checkpoint`` policy; ``"full"`` saves every activation
#: (no rematerialisation). ``"offload"`` saves what ``"nothing_saved"`` saves, the layer
#: inputs, in pinned host memory instead of device memory (copied out in the forward, back
#: in the backward; MaxText's ``remat_policy`` of the same purpose); on a backend without a
#: separate host memory (XLA:CPU) it is ``"nothing_saved"``.
REMAT_POLICIES: dict[str, Callable | None] = {
    "nothing_saved": jax.checkpoint_policies.nothing_saveable,
    "dots_saved": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "offload": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
        offload_src="device", offload_dst="pinned_host"),
    "full": None,
}


def name_layer_input(x):
    """``x`` (any pytree of arrays) tagged ``LAYER_INPUT`` for the remat policies."""
    return jax.tree.map(lambda a: checkpoint_name(a, LAYER_INPUT), x)


def stack_modules(modules: Sequence[nnx.Module]) -> nnx.Module:
    """One module of the same class whose parameters are those of ``modules`` stacked on a
    new leading axis: a ``[...]`` parameter with logical axes ``axes`` becomes
    ``[len(modules), ...]`` with ``(LAYER_AXIS, *axes)``.

    Raises:
      ValueError: ``modules`` is empty, or the modules differ in structure (parameter
        paths, or a parameter's shape / dtype; the path is named).
    """
    if not modules:
        raise ValueError("stack_modules needs at least one module")
    graphdef, _ = nnx.split(modules[0])
    flats = [nnx.to_flat_state(nnx.state(m)) for m in modules]
    flat = []
    for items in zip(*flats, strict=True):
        (path, var), values = items[0], [v[...] for _, v in items]
        if any(p != path or v.shape != var.shape or v.dtype != var.dtype
               for (p, _), v in zip(items, values, strict=True)):
            raise ValueError(f"cannot stack modules that differ at {'/'.join(map(str, path))}")
        axes = var.get_metadata().get("out_sharding")
        meta = {} if axes is None else {"out_sharding": (LAYER_AXIS, *axes)}
        flat.append((path, var.replace(jnp.stack(values), **meta)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def layer_at(stacked: nnx.Module, index: int) -> nnx.Module:
    """The ``index``-th layer of a stacked module (every parameter sliced on axis 0)."""
    graphdef, state = nnx.split(stacked)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[index], state))


def scan_layers(stacked: nnx.Module, body: Callable, carry, *, policy: str = "full"):
    """Apply the layers of ``stacked`` in order with ``jax.lax.scan``.

    Args:
      stacked: a module from ``stack_modules`` (L layers).
      body: ``body(layer, carry) -> (carry, out)``; ``layer`` is one unstacked layer,
        ``carry`` any pytree whose shapes and dtypes the body keeps, ``out`` any pytree
        (None for nothing).
      carry: the initial carry.
      policy: a ``REMAT_POLICIES`` name: what the backward pass saves of each layer.

    Returns:
      ``(carry, outs)``: the final carry and the per-layer ``out`` stacked on a leading
      ``[L]`` axis.

    Raises:
      KeyError: an unknown ``policy`` (the known ones named).
    """
    if policy not in REMAT_POLICIES:
        raise KeyError(f"unknown remat policy {policy!r}; known: {sorted(REMAT_POLICIES)}")
    graphdef, state = nnx.split(stacked)

    def step(carry, layer_state):
        return body(nnx.merge(graphdef, layer_state), name_layer_input(carry))

    if REMAT_POLICIES[policy] is not None:
        step = jax.checkpoint(step, policy=REMAT_POLICIES[policy], prevent_cse=False)
    return jax.lax.scan(step, carry, state)
