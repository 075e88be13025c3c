"""Logical axis names of the decoder's parameters and their placement on a device mesh.

Every parameter carries one logical name per dimension (``nnx.Param`` metadata
``out_sharding``, stored without a mesh). ``DEFAULT_RULES`` map the names to the axes of
``models.mesh`` (``data, fsdp, expert, tensor``); ``state_shardings`` turns a state into
``NamedSharding`` s, ``init_sharded`` creates a model in its layout, ``jit_sharded``
compiles a step under the mesh.

The rules are data: a ``ModelConfig`` carries them (``sharding_rules``, default
``DEFAULT_RULES``; a trainer sets them from its config, ``mesh.rules``), and the
expert-parallel MoE reads them from there.
"""

from __future__ import annotations

import functools
import math

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.mesh import auto_axes

#: Every logical axis name a parameter may use.
LOGICAL_AXES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "expert", "layers")


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


#: Logical axis -> mesh axis (or None: replicated), for the ``models.mesh`` axes:
#: experts over ``expert``; the hidden ("embed") dimension over ``fsdp`` and ``context``
#: (ZeRO-3: the context devices hold a share of every weight too, as MaxText shards its
#: parameters over its sequence axes; without it each of them would hold the whole fsdp
#: shard and its Adam moments);
#: heads, MLP width and vocabulary over ``tensor`` (Megatron); ``head_dim`` and the stacked
#: layer axis of ``ModelConfig.scan_layers`` (``"layers"``) replicated.
DEFAULT_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("expert", "expert"),
    ("embed", ("fsdp", "context")),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("layers", None),
)


#: Logical axes that may be narrower than their mesh axes: a size that divides the device
#: count is replicated over them (``logical_to_mesh``; ``kv_head_layout`` says why).
NARROW_AXES = ("kv_heads",)


def kv_head_layout(num_heads: int, num_kv_heads: int, mesh, rules=DEFAULT_RULES) -> int:
    """How many tensor shards read each KV head: 1 when the KV heads split over the mesh
    axes of ``"kv_heads"`` (``tensor`` by default), ``T // K`` when those T devices are
    more than the K KV heads.

    Tensor parallelism wider than the KV heads (Qwen3-30B-A3B's 4 on tensor=8): the N query
    heads split T ways, N / T per shard, and since T is a multiple of K the query heads of
    shard ``s`` all read KV head ``s // (T // K)``. The layout: ``k_proj`` / ``v_proj``
    ``[H, K, D]`` keep their shape and are replicated over ``tensor`` (still split over
    ``fsdp`` on ``embed``); every shard projects its tokens to all K heads and its query
    heads read theirs. Chosen over a copy of each head per shard (``[H, T, D]``, vLLM's
    layout) because

    * the parameters are unchanged: same shapes, same values, only their ``NamedSharding``
      differs, so checkpoints restore on any mesh and ``models.hf`` maps the same tensors;
    * the gradients are exact: each weight exists once, and its gradient is the sum of the
      shards' contributions, which the partitioner all-reduces over ``tensor`` (the sum one
      device computes, in another order). Copies would need their gradients summed and the
      optimiser to keep them identical;
    * the cost is small: each shard projects K heads instead of K / T of one (for
      Qwen3-30B-A3B at tensor=8: 2 x 2048 x 4 x 128 multiply-adds per token and layer,
      against 2048 x 32 x 128 x 2 / 8 for its query and output projections), and holds the
      two K/V weights whole on its fsdp shard (2 x 1 M parameters a layer).

    Args:
      num_heads, num_kv_heads: N and K of the model.
      mesh: a ``Mesh`` / ``AbstractMesh`` (axes it lacks count as size 1).
      rules: the logical -> mesh axis rules (the devices of ``"kv_heads"``' axes are T).

    Returns:
      ``T // K`` if ``T > K``, else 1.

    Raises:
      ValueError: T above K but not a multiple of K, or not dividing N (the values named).
    """
    axes = dict(rules).get("kv_heads")
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    sizes = {a: dict(mesh.shape)[a] for a in axes if a in dict(mesh.shape)}
    devices = math.prod(sizes.values())
    if devices <= num_kv_heads:
        return 1
    if devices % num_kv_heads or num_heads % devices:
        raise ValueError(
            f"tensor parallelism over {devices} devices (mesh axes {sizes}) wider than "
            f"num_key_value_heads={num_kv_heads} needs a multiple of {num_kv_heads} devices "
            f"that divides num_attention_heads={num_heads}"
        )
    return devices // num_kv_heads


def normalize_rules(rules) -> tuple[tuple[str, str | tuple[str, ...] | None], ...]:
    """``rules`` as a hashable tuple of ``(logical name, mesh axis | tuple of axes | None)``
    pairs (lists, e.g. parsed from a command line, become tuples).

    Raises:
      ValueError: an entry that is not such a pair (the entry named).
    """
    out = []
    for entry in rules:
        if isinstance(entry, (str, bytes)) or len(entry) != 2 or not isinstance(entry[0], str):
            raise ValueError(f"a sharding rule is (logical name, mesh axes), got {entry!r}")
        name, axes = entry
        if axes is not None and not isinstance(axes, str):
            axes = tuple(axes)
            if not all(isinstance(a, str) for a in axes):
                raise ValueError(f"sharding rule {entry!r}: mesh axes must be names")
        out.append((name, axes))
    return tuple(out)


def logical_to_mesh(names, mesh, rules=DEFAULT_RULES, shape=None, what="array") -> P:
    """The ``PartitionSpec`` of an array whose dimensions have logical ``names``.

    Each name maps to the mesh axes ``rules`` give it; axes the mesh lacks, and axes an
    earlier dimension already uses, are dropped, and of several axes those of size 1
    (``("fsdp", "context")`` on a mesh without context parallelism is ``"fsdp"``); names
    without a rule are replicated.

    The one exception to divisibility is ``"kv_heads"`` (``NARROW_AXES``): K KV heads on
    more devices than K (tensor parallelism wider than the KV heads, e.g. Qwen3-30B-A3B's 4
    on tensor=8), the device count a multiple of K, are replicated over those axes instead
    (see ``kv_head_layout``).

    Args:
      names: one logical name (or None) per dimension.
      mesh: a ``Mesh`` / ``AbstractMesh``.
      rules: ``(logical name, mesh axis | tuple of axes | None)`` pairs.
      shape: the array's shape, to check divisibility.
      what: the array's name for errors.

    Raises:
      ValueError: a dimension not divisible by the devices of its mesh axes (the array,
        dimension, sizes and axes named); for ``"kv_heads"``, a size that neither divides
        nor is divided by them.
    """
    table = dict(rules)
    sizes = dict(mesh.shape)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(names):
        axes = table.get(name)
        axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
        axes = tuple(a for a in axes if a in sizes and a not in used)
        if len(axes) > 1:  # of several axes, those of size 1 say nothing
            axes = tuple(a for a in axes if sizes[a] > 1) or axes[:1]
        devices = math.prod(sizes[a] for a in axes)
        if shape is not None and shape[dim] % devices:
            if name in NARROW_AXES and devices % shape[dim] == 0:
                axes = ()
            else:
                also = (f" (nor a divisor of {devices}, which would replicate it)"
                        if name in NARROW_AXES else "")
                raise ValueError(
                    f"{what} of shape {tuple(shape)}: dimension {dim} ({name}) of size "
                    f"{shape[dim]} is not divisible by the {devices} devices of mesh axes "
                    f"{axes}{also}"
                )
        used.update(axes)
        spec.append(axes[0] if len(axes) == 1 else axes or None)
    return P(*spec)


def state_shardings(state: nnx.State, mesh: Mesh, rules=DEFAULT_RULES) -> nnx.State:
    """``state`` (parameters, optimizer state, any ``nnx.State``) with every variable's
    value replaced by its ``NamedSharding``: the logical axes in its ``out_sharding``
    metadata mapped by ``rules`` (``logical_to_mesh``); variables without one (step
    counters, RNG state) are replicated. Usable as ``jax.jit`` in/out shardings and with
    ``jax.device_put``.

    Raises:
      ValueError: as ``logical_to_mesh`` (the variable's path is named).
    """
    mesh = auto_axes(mesh)
    flat = []
    for path, var in nnx.to_flat_state(state):
        names = var.get_metadata().get("out_sharding")
        shape = getattr(var, "shape", ())
        if names is None or len(names) != len(shape):
            spec = P()
        else:
            spec = logical_to_mesh(names, mesh, rules, shape, "/".join(map(str, path)))
        flat.append((path, var.replace(NamedSharding(mesh, spec))))
    return nnx.from_flat_state(flat)


def init_sharded(factory, mesh: Mesh | None = None, rules=DEFAULT_RULES) -> nnx.Module:
    """``factory()`` (e.g. ``lambda: Transformer(cfg, rngs=nnx.Rngs(0))``) initialised inside
    one ``jax.jit`` (eager NNX init runs one dispatch per initialiser and is several times
    slower). With a ``mesh``, every variable is created directly in its sharded layout
    (the rules' out-shardings), so no device ever holds the whole model; None: on the
    default device. The values do not depend on the mesh.
    """
    graphdef, abstract_state = nnx.split(nnx.eval_shape(factory))
    mesh = auto_axes(mesh)
    if mesh is None:
        return nnx.merge(graphdef, jax.jit(lambda: nnx.state(factory()))())
    shardings = state_shardings(abstract_state, mesh, rules)
    init = jax.jit(lambda: nnx.state(factory()), out_shardings=shardings)
    with jax.set_mesh(mesh):
        return nnx.merge(graphdef, init())


def _on_auto_axes(tree):
    """``tree`` with every ``NamedSharding`` (as a leaf, or of a ``jax.Array`` leaf) moved
    to ``auto_axes`` of its mesh: the same devices and layout, so arrays are not copied."""

    def leaf(x):
        if isinstance(x, NamedSharding):
            return x.update(mesh=auto_axes(x.mesh))
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.Array) and isinstance(sharding, NamedSharding) and \
                not sharding.mesh.are_all_axes_auto:
            return jax.device_put(x, sharding.update(mesh=auto_axes(sharding.mesh)))
        return x

    return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, NamedSharding))


def jit_sharded(fn, mesh: Mesh, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)`` (``in_shardings`` / ``out_shardings`` / ``donate_argnums``
    ...) traced and run under ``jax.set_mesh(mesh)``, which the expert-parallel MoE needs
    to see the mesh. A mesh of any axis types runs with its axes Auto
    (``models.mesh.auto_axes``), and so do shardings and arrays placed on it. The result
    also has ``.lower(*args)`` (for HLO and memory analysis).
    """
    jitted = jax.jit(fn, **_on_auto_axes(jit_kwargs))
    mesh = auto_axes(mesh)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with jax.set_mesh(mesh):
            return jitted(*_on_auto_axes(args), **_on_auto_axes(kwargs))

    def lower(*args, **kwargs):
        with jax.set_mesh(mesh):
            return jitted.lower(*_on_auto_axes(args), **_on_auto_axes(kwargs))

    call.lower = lower
    return call
