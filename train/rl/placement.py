"""Where a run's arrays live: the mesh, the parameters, the optimiser state, the batches.

``train.sft`` / ``train.grpo`` read the config section ``mesh``: the axis sizes of
``models.mesh.make_mesh`` over all global devices (default: every device on ``data``) and
``mesh.rules``, the logical -> mesh axis rules (``models.sharding``), which the model
config carries too (``ModelConfig.sharding_rules``: the expert-parallel MoE follows them),
so the model and its placement cannot disagree.

Data flow on several processes (``train.run.distributed``): every process runs the same
program on the same data. Rollouts are one global SPMD program under the mesh
(``train.rl.rollout``): the prompts and the RNG key are the same on every process, each
device decodes its rows (split over the batch axes, parameters in their training layout,
the MoE expert-parallel, the KV cache split along the batch), and every process reads
back all rows (``to_host``: a ``process_allgather`` of the small ``[B, T]`` results), so
every process holds the same packed global batch; ``place_batch`` hands each device its
rows of it, the head's bucket is the fullest token shard's (``Placement.bucket``, the
same on every process since every process holds the same batch) and the jitted steps run
with in/out shardings under ``jax.set_mesh`` (``Placement.jit``: the MoE is
expert-parallel, the head runs per token shard, see ``models.Transformer.token_logprobs``).
Rollouts are data / expert / fsdp parallel and give the numbers of one process (a row's
sampling noise depends on the key and its global index only); the training step is data
/ expert / fsdp / tensor parallel. On one device nothing changes: plain ``jax.jit``, no
mesh in the steps, the plain head.

Only process 0 writes metrics (``MetricsWriter(enabled=...)``, tqdm, eval JSON); every
process takes part in orbax saves and restores (``train.run.checkpoint``), which restore into
the current shardings, so a checkpoint written by N processes restores on any device
count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import models
from models.mesh import (
    AXES,
    BATCH_AXES,
    auto_axes,
    axis_size,
    batch_sharding,
    check_divisible,
    make_mesh,
)
from models.sharding import logical_to_mesh
from models.transformer import head_bucket
from train.rl import state


def place_batch(arrays: Mapping[str, np.ndarray], mesh: Mesh | None = None, *,
                per_process: bool = False) -> dict[str, jax.Array]:
    """Host arrays ``[B, ...]`` as device arrays whose rows are split over the batch axes
    (``models.mesh.BATCH_AXES``) of ``mesh``: the one place a batch goes to the devices.

    Args:
      arrays: name -> host array, all with the same leading (row) dimension.
      mesh: the run's mesh; None or a one-device mesh: plain arrays on the default device.
      per_process: False (the trainer): every process passes the same global batch and
        each device takes its rows of it. True: each process passes its own rows and the
        global batch is their concatenation in process order.

    Returns:
      name -> ``jax.Array`` (global arrays on a mesh).

    Raises:
      ValueError: a global row count not divisible by the batch shards, before anything is
        transferred or compiled (both numbers named).
    """
    if mesh is None or mesh.size == 1:
        return {k: jnp.asarray(v) for k, v in arrays.items()}
    sharding = batch_sharding(mesh)

    def put(x):
        x = np.asarray(x)
        rows = x.shape[0] * (jax.process_count() if per_process else 1)
        check_divisible(rows, mesh)
        global_shape = None if per_process else x.shape  # the same data on every process
        return jax.make_array_from_process_local_data(sharding, x, global_shape)

    return {k: put(v) for k, v in arrays.items()}


def to_host(tree):
    """``jax.device_get`` that also reads arrays spread over several processes (every
    process gets the whole value; all processes must call it for such arrays)."""
    def get(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            if x.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(get, tree)


def _global(x, sharding: NamedSharding) -> jax.Array:
    """A global array with ``sharding`` from a value every process holds in full."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(to_host(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


class Placement:
    """The mesh of a run and where its arrays live.

    Attributes:
      mesh: the ``models.mesh`` mesh over all global devices, its axes Auto
        (``models.mesh.auto_axes`` of the mesh given, of any axis types).
      sharded: more than one device (else the steps run exactly as without a mesh).
      mdef: the model definition (``train.rl.state.ModelDef``).
      rules: the logical -> mesh axis rules (``mdef.cfg.sharding_rules``).
      params: parameter key -> ``NamedSharding`` (the parameter's logical axes mapped by
        ``rules``).
      replicated, batch: ``NamedSharding`` s of replicated values and of ``[B, ...]``
        arrays split over the batch axes.
      batch_shards: how many shards a batch splits into (``BATCH_AXES``).

    Raises:
      ValueError: a parameter dimension not divisible by its mesh axes (named).
    """

    def __init__(self, mesh: Mesh, mdef: state.ModelDef):
        mesh = auto_axes(mesh)
        self.mesh, self.mdef = mesh, mdef
        self.sharded = mesh.size > 1
        self.rules = mdef.cfg.sharding_rules
        self.replicated = NamedSharding(mesh, P())
        self.batch = batch_sharding(mesh)
        self.batch_shards = axis_size(mesh, BATCH_AXES)
        self._abstract = mdef.abstract_params()
        self.params = {
            k: NamedSharding(mesh, logical_to_mesh(names, mesh, self.rules,
                                                   self._abstract[k].shape, k))
            for k, names in mdef.logical_axes().items()}

    @classmethod
    def from_config(cls, cfg, mdef: state.ModelDef) -> Placement:
        """The placement of ``cfg.mesh``'s axis sizes (absent: every device on ``data``);
        the rules are the model's (``setup`` puts ``cfg.mesh.rules`` there).

        Raises:
          ValueError: axis sizes that do not multiply to the device count (both named).
        """
        mesh_cfg = cfg.get("mesh")
        sizes = None if mesh_cfg is None else {a: mesh_cfg[a] for a in AXES if a in mesh_cfg}
        return cls(make_mesh(sizes), mdef)

    # -- parameters and optimiser state ------------------------------------------------

    def abstract_params(self) -> state.Params:
        """Every parameter as a ``jax.ShapeDtypeStruct`` with its target sharding (restore
        target of a checkpoint's params)."""
        return {k: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self.params[k])
                for k, a in self._abstract.items()}

    def opt_shardings(self, tx):
        """``NamedSharding`` of every leaf of ``tx.init(params)`` (arrays not allocated).

        Derived, not guessed: ``tx.init`` is traced (``jax.eval_shape``) on the abstract
        parameters typed with their shardings over an ``Explicit``-axes copy of the mesh,
        so JAX's sharding-in-types gives every optimiser leaf the sharding of the value it
        is computed from: a moment built as ``zeros_like(param)`` gets its parameter's,
        a counter none (then replicated). Nothing is matched by key or shape, and any
        optax chain works (``multi_transform`` groups, masked states, frozen parameters
        without state). ``optax.tree_utils.tree_map_params`` would need ``tx.init`` to
        accept a placeholder for the whole parameter tree, which ``multi_transform``'s
        label function does not.
        """
        explicit = AbstractMesh(self.mesh.axis_sizes, self.mesh.axis_names,
                                axis_types=(AxisType.Explicit,) * len(self.mesh.axis_names))
        typed = {k: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                         sharding=NamedSharding(explicit, self.params[k].spec))
                 for k, a in self._abstract.items()}
        with jax.sharding.use_abstract_mesh(explicit):
            opt = jax.eval_shape(tx.init, typed)

        def leaf(x):
            spec = x.sharding.spec if isinstance(x.sharding, NamedSharding) else P()
            return NamedSharding(self.mesh, spec)

        return jax.tree.map(leaf, opt)

    def abstract_state(self, tx) -> dict:
        """``{"params", "opt_state"}`` as ``ShapeDtypeStruct`` s with their target
        shardings: restore targets for ``Checkpointer.restore``."""
        opt = jax.eval_shape(tx.init, self._abstract)
        opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                           opt, self.opt_shardings(tx))
        return {"params": self.abstract_params(), "opt_state": opt}

    def place_params(self, params: state.Params) -> state.Params:
        """``params`` in their mesh layout (a no-op for arrays already there)."""
        if not self.sharded:
            return params
        return {k: _global(v, self.params[k]) for k, v in params.items()}

    def init_params(self, seed: int) -> state.Params:
        """Random initial parameters (``models.init_sharded``: one ``jit``, created in the
        mesh layout; the values do not depend on the mesh)."""
        cfg = self.mdef.cfg
        model = models.init_sharded(lambda: models.Transformer(cfg, rngs=nnx.Rngs(seed)),
                                    self.mesh if self.sharded else None, self.rules)
        return state.params_of(model)

    def init_opt(self, tx, params: state.Params):
        """``tx.init(params)`` created directly in its sharded layout."""
        if not self.sharded:
            return tx.init(params)
        return jax.jit(tx.init, out_shardings=self.opt_shardings(tx))(params)

    # -- steps -------------------------------------------------------------------------

    def jit(self, fn: Callable, *, in_shardings=None, out_shardings=None, **jit_kwargs):
        """``jax.jit(fn, **jit_kwargs)``; on a multi-device mesh compiled with
        ``in_shardings`` / ``out_shardings`` (None: the inputs' own layout, the compiler's
        choice) and traced and run under ``jax.set_mesh`` (``models.jit_sharded``)."""
        if not self.sharded:
            return jax.jit(fn, **jit_kwargs)
        if in_shardings is not None:
            jit_kwargs["in_shardings"] = in_shardings
        if out_shardings is not None:
            jit_kwargs["out_shardings"] = out_shardings
        return models.jit_sharded(fn, self.mesh, **jit_kwargs)

    def update_shardings(self, tx) -> tuple:
        """``out_shardings`` of an update step ``-> (params, opt_state, metrics)``."""
        return self.params, self.opt_shardings(tx), self.replicated

    # -- batches -----------------------------------------------------------------------

    def row_multiple(self, multiple: int) -> int:
        """A packed batch's row multiple that also splits over the batch shards."""
        return math.lcm(max(1, multiple), self.batch_shards) if self.sharded else multiple

    def bucket(self, packed, multiple: int, max_kept: int | None = None) -> int:
        """The head's static bucket of a ``train.rl.packing.PackedBatch``: ``packed.bucket``
        on one device; on a mesh the rung of the fullest token shard
        (``jaxhead.bucket_for_shards``; with context parallelism the shards of
        ``models.context``'s token-major rows; every process holds the same global batch, so
        no collective is needed). Either way at most ``max_kept`` (the most tokens the batch
        can keep; no shard keeps more)."""
        if not self.sharded:
            return packed.bucket(multiple, max_kept)
        rung = self.shard_bucket(packed.keep, multiple)
        return rung if max_kept is None else min(rung, max_kept)

    def shard_bucket(self, keep, multiple: int = 128) -> int:
        """The head's bucket for a bool ``[B, S]`` keep mask on this mesh, as the model
        lays out the head's rows (``models.transformer.head_bucket``: rows over the batch
        axes and, with context parallelism, the token-major rows over ``context`` too)."""
        return head_bucket(keep, self.mesh, multiple)
