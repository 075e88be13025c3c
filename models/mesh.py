"""The device mesh of the models: axis names, sizes from a config, batch axes.

Axes, always all five and in this order (size-1 axes cost nothing)::

    data    pure data parallelism: the batch is split, every parameter replicated
    fsdp    the batch is split and parameters are sharded on their "embed" dimension
            (ZeRO-3: XLA all-gathers a layer's weights where they are used)
    expert  the batch is split outside the MoE blocks; inside, each device owns
            E / expert experts and tokens travel to them by all-to-all (GShard)
    context context parallelism: each sequence's tokens are split (``models.context``):
            attention gathers the keys and values of the whole sequence per layer,
            everything else is per token; parameters are replicated over it
    tensor  Megatron-style tensor parallelism: attention heads, MLP width and the
            vocabulary are split; the batch is replicated

The batch's rows are split over ``BATCH_AXES = ("data", "fsdp", "expert")``, its tokens
within a row over ``CONTEXT_AXIS``. Parameter placement rules live in ``models.sharding``.

Axis types: every axis is ``AxisType.Auto`` (``jax.make_mesh`` defaults to Explicit in
recent JAX). The model code carries no sharding annotations; under ``jax.jit`` with
``NamedSharding`` in/out shardings the compiler propagates the layout (GSPMD / Shardy),
and the parts whose communication matters are written explicitly with ``jax.shard_map``
(MoE all-to-all in ``models.moe.api``, the head in
``jaxhead.sharded_token_logprobs``, given ``BATCH_AXES`` as its token axes). With Explicit
axes every ambiguous op in the model would need an ``out_sharding``, so every function
here and in ``models.sharding`` / ``models.moe`` / ``train.rl.placement`` that takes a mesh
takes one of any axis types (e.g. ``jax.make_mesh``'s default, Explicit) and uses it with
its axes Auto (``auto_axes``: the same devices and names).

Processes (``jax.distributed``) and placing host batches are the trainer's
(``train.run.distributed``, ``train.rl.placement``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXES = ("data", "fsdp", "expert", "context", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")
CONTEXT_AXIS = "context"


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the mesh axes (see the module docstring). One size may be ``-1``: it takes
    the devices the others leave (``data=-1`` by default: pure data parallelism).

    Build one from a trainer config with ``MeshConfig.from_config(config.mesh)`` (a
    mapping or an object with these attributes, e.g. an ``ml_collections.ConfigDict``).
    """

    data: int = -1
    fsdp: int = 1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    @classmethod
    def from_config(cls, config) -> MeshConfig:
        """A ``MeshConfig`` from a mapping / attribute object; missing axes keep their
        defaults.

        Raises:
          ValueError: a key that is not a mesh axis (the valid ones are listed).
        """
        if isinstance(config, MeshConfig):
            return config
        if isinstance(config, Mapping):
            items = dict(config)
        elif hasattr(config, "to_dict"):  # ml_collections.ConfigDict
            items = config.to_dict()
        else:
            items = dict(vars(config))
        unknown = set(items) - set(AXES)
        if unknown:
            raise ValueError(f"unknown mesh axes {sorted(unknown)}; the axes are {AXES}")
        return cls(**{k: int(v) for k, v in items.items()})

    def shape(self, num_devices: int) -> tuple[int, ...]:
        """The axis sizes in ``AXES`` order for ``num_devices`` devices (``-1`` filled in).

        Raises:
          ValueError: a size below 1 other than one ``-1``, or sizes whose product is not
            ``num_devices`` (both numbers named).
        """
        sizes = [getattr(self, a) for a in AXES]
        free = [a for a, s in zip(AXES, sizes, strict=True) if s == -1]
        bad = [f"{a}={s}" for a, s in zip(AXES, sizes, strict=True) if s < 1 and s != -1]
        if bad or len(free) > 1:
            raise ValueError(f"mesh sizes must be >= 1 with at most one -1, got {self}")
        fixed = math.prod(s for s in sizes if s != -1)
        if free:
            if num_devices % fixed:
                raise ValueError(
                    f"mesh {self} cannot fill {num_devices} devices: the fixed axes "
                    f"multiply to {fixed}, which does not divide {num_devices}"
                )
            sizes = [num_devices // fixed if s == -1 else s for s in sizes]
        elif fixed != num_devices:
            raise ValueError(
                f"mesh {self} needs {fixed} devices but there are {num_devices} "
                f"(jax.device_count() over all processes)"
            )
        return tuple(sizes)


def make_mesh(config=None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ``("data", "fsdp", "expert", "context", "tensor")`` mesh over all global
    devices.

    Args:
      config: a ``MeshConfig``, a mapping / config object with some of its fields, or None
        (all devices on ``data``).
      devices: devices to use (default ``jax.devices()``: every device of every process).

    Returns:
      A ``jax.sharding.Mesh`` built with ``jax.make_mesh`` (topology-aware device order;
      where no mesh axis matches a TPU slice's physical axes, with physical axes split,
      ``mesh_utils.create_device_mesh(..., allow_split_physical_axes=True)``), every axis
      ``AxisType.Auto``.

    Raises:
      ValueError: sizes that do not multiply to the number of devices (both named).
    """
    cfg = MeshConfig() if config is None else MeshConfig.from_config(config)
    devices = list(jax.devices() if devices is None else devices)
    shape = cfg.shape(len(devices))
    types = (AxisType.Auto,) * len(AXES)
    try:
        return jax.make_mesh(shape, AXES, axis_types=types, devices=devices)
    except NotImplementedError:
        # a TPU slice whose physical axes no subset of mesh axes matches (e.g. context=4 on
        # v6e:8x8's 8 x 8): split a physical axis, keeping each mesh axis's devices close
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(grid, AXES, axis_types=types)


def auto_axes(mesh):
    """``mesh`` (a ``Mesh`` or ``AbstractMesh``) with every axis ``AxisType.Auto``: the
    same devices, names and sizes; ``mesh`` itself when it has no other axis type (and
    None for None)."""
    if mesh is None or mesh.are_all_axes_auto:
        return mesh
    return mesh.update(axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def free_axes(mesh) -> dict[str, int]:
    """``{name: size}`` of the axes of ``mesh`` (a ``Mesh`` or ``AbstractMesh``) that are
    not ``AxisType.Manual``: those a ``jax.shard_map`` here may still make manual (outside
    any, every axis), size-1 ones included, in the mesh's order."""
    return {name: size for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes,
                                                    mesh.axis_types)
            if kind != AxisType.Manual}


def axis_size(mesh, axes: str | Sequence[str]) -> int:
    """Product of the sizes of ``axes`` (names absent from ``mesh`` count as 1)."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(dict(mesh.shape).get(a, 1) for a in axes)


def present(mesh, axes: Sequence[str]) -> tuple[str, ...]:
    """The names of ``axes`` that ``mesh`` has, in order."""
    return tuple(a for a in axes if a in mesh.axis_names)


def check_divisible(rows: int, mesh, axes: Sequence[str] = BATCH_AXES, what="batch") -> None:
    """Raise unless ``rows`` splits evenly over the mesh axes ``axes``.

    Raises:
      ValueError: naming ``rows``, the number of shards and the axes' sizes.
    """
    shards = axis_size(mesh, axes)
    if rows % shards:
        sizes = {a: dict(mesh.shape).get(a, 1) for a in axes}
        raise ValueError(
            f"{what} of {rows} rows is not divisible by the {shards} shards of mesh axes "
            f"{sizes}; use a multiple of {shards}"
        )


def batch_sharding(mesh: Mesh, axes: Sequence[str] = BATCH_AXES) -> NamedSharding:
    """``NamedSharding`` splitting the leading (batch) axis over ``axes`` (of
    ``auto_axes(mesh)``)."""
    return NamedSharding(auto_axes(mesh), P(present(mesh, axes)))


def active_mesh():
    """The mesh set with ``jax.set_mesh`` (e.g. by ``models.jit_sharded``) while tracing,
    if it has more than one device; else None (no mesh, or a one-device mesh: the
    single-device code paths apply)."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty or mesh.size == 1 else mesh
