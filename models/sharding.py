"""Logical axis names of the decoder's parameters, for mapping onto a device mesh.

Every parameter carries one logical name per dimension (``nnx.Param`` metadata
``out_sharding``, stored without a mesh). A sharding layer maps the names to mesh axes
with rules such as ``(("vocab", "model"), ("embed", "fsdp"), ("expert", "expert"))``.
"""

from __future__ import annotations

from flax import nnx

#: Every logical axis name a parameter may use.
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert")


def logical_axes(model: nnx.Module) -> dict[tuple, tuple[str, ...]]:
    """Flat map: parameter path (as in ``nnx.to_flat_state``) -> logical axis names.

    Raises:
      ValueError: a parameter without names, with one name per dimension missing, or with
        a name outside ``LOGICAL_AXES`` (the path is named).
    """
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        axes = var.get_metadata().get("out_sharding")
        if axes is None or len(axes) != len(var.shape) or not set(axes) <= set(LOGICAL_AXES):
            raise ValueError(
                f"parameter {'/'.join(map(str, path))} of shape {var.shape} has logical axes "
                f"{axes}; expected one of {LOGICAL_AXES} per dimension"
            )
        out[path] = tuple(axes)
    return out


def logical_partition_specs(model: nnx.Module) -> nnx.State:
    """The parameter state of ``model`` with each value replaced by the
    ``PartitionSpec`` of its logical axis names (e.g. ``P("embed", "heads", "head_dim")``
    for ``q_proj``), the tree ``nnx.get_partition_spec`` gives; a sharding layer maps
    the logical names to mesh axes with its rules.

    Raises:
      ValueError: as ``logical_axes`` (every parameter must be named).
    """
    logical_axes(model)
    return nnx.get_partition_spec(nnx.state(model, nnx.Param))
