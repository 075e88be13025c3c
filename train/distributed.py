"""The trainers under a device mesh and on several hosts (``jax.distributed``).

``train.sft`` / ``train.grpo`` read two config sections (``train.config``):

* ``distributed``: ``coordinator_address`` / ``num_processes`` / ``process_id`` (empty:
  the ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment
  variables; none of them set: one process), or ``enabled=True`` for
  ``jax.distributed.initialize()``'s own cluster detection (Cloud TPU pod slices, SLURM,
  Open MPI, Kubernetes). ``initialize(cfg)`` runs before any other JAX call.
* ``mesh``: the axis sizes of ``models.mesh.make_mesh`` over all global devices
  (default: every device on ``data``).

``Placement`` holds the mesh and the ``NamedSharding`` of every parameter (the models'
logical axes mapped by ``models.sharding.DEFAULT_RULES``: experts over ``expert``, ...)
and of the optimiser state (each moment like its parameter; counters replicated).

Data flow on several processes: every process runs the same program on the same data.
Rollouts are one global SPMD program (the parameters stay in their training layout; the
prompts, the RNG key and thus the sampled completions are the same on every process,
and every process reads back all of them), so every process holds the same packed global
batch; ``Placement.device_batch`` hands each device its rows of it, the head's bucket is
the fullest token shard's (``jaxhead.bucket_for_shards``, the same on every process
since every process holds the same batch) and the jitted steps run with
in/out shardings under ``jax.set_mesh`` (the MoE is expert-parallel, the head runs per
token shard through ``jaxhead.sharded_token_logprobs``). Rollouts are replicated work
(simple and exactly the single-process numbers); the training step is data / expert /
fsdp / tensor parallel. On one device nothing changes: no mesh in the steps, the plain
head and the unchanged jitted functions.

Only process 0 writes metrics (``MetricsWriter(enabled=...)``, tqdm, eval JSON); every
process takes part in orbax saves and restores (``train.checkpoint``), which restore into
the current shardings, so a checkpoint written by N processes restores on any device
count.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhead
import models
from models.mesh import (
    BATCH_AXES,
    axis_size,
    batch_sharding,
    check_divisible,
    make_mesh,
    present,
)
from train import state

_ENV = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")


def initialize_distributed(coordinator_address: str | None = None,
                           num_processes: int | None = None,
                           process_id: int | None = None) -> tuple[int, int]:
    """Start JAX's multi-controller runtime (``jax.distributed.initialize``) once per process.

    Arguments left None come from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``; when none is set anywhere, ``jax.distributed.initialize()`` is
    called without arguments and detects the cluster itself (Cloud TPU pod slices, SLURM,
    Open MPI, Kubernetes ...). Call it before any other JAX call.

    Returns:
      ``(jax.process_index(), jax.process_count())``.
    """
    env = os.environ
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and "JAX_NUM_PROCESSES" in env:
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in env:
        process_id = int(env["JAX_PROCESS_ID"])
    kwargs = {"coordinator_address": address, "num_processes": num_processes,
              "process_id": process_id}
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if v is not None})
    return jax.process_index(), jax.process_count()


def initialize(cfg) -> tuple[int, int]:
    """Start ``jax.distributed`` from ``cfg.distributed`` / the environment when a run
    spans several processes; call before any other JAX call. Returns
    ``(process index, process count)``."""
    d = cfg.get("distributed")
    if d is None:
        return 0, 1
    explicit = bool(d.coordinator_address) or d.num_processes > 0 or d.process_id >= 0
    if not (explicit or d.enabled or any(k in os.environ for k in _ENV)):
        return 0, 1
    return initialize_distributed(d.coordinator_address or None, d.num_processes or None,
                                  None if d.process_id < 0 else d.process_id)


def shard_batch(batch, mesh, axes=BATCH_AXES):
    """Place a pytree of host arrays ``[B_local, ...]`` as global arrays split over ``axes``.

    Each process passes its own rows (a single process: the whole batch); the global batch
    is the concatenation over processes in process order
    (``jax.make_array_from_process_local_data``).

    Raises:
      ValueError: a global row count not divisible by the batch shards, before anything is
        transferred or compiled (both numbers named).
    """
    sharding = batch_sharding(mesh, axes)

    def put(x):
        x = np.asarray(x)
        check_divisible(x.shape[0] * jax.process_count(), mesh, axes)
        return jax.make_array_from_process_local_data(sharding, x)

    return jax.tree.map(put, batch)


def mesh_active() -> bool:
    """True while tracing under ``jax.set_mesh`` with a mesh of more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.size > 1


def token_logprobs(model, tokens, positions, segment_ids, labels, keep=None, *,
                   temperature=1.0, with_entropy=True, bucket=None):
    """``model.token_logprobs``; under a multi-device mesh the head runs per token shard
    (``LMHead.sharded``: each shard compacts its kept tokens into ``bucket`` slots, the
    bucket from ``bucket_for_shards``)."""
    if not mesh_active():
        return model.token_logprobs(tokens, positions, segment_ids, labels, keep,
                                    temperature=temperature, with_entropy=with_entropy,
                                    bucket=bucket)
    out = model(tokens, positions, segment_ids)
    axes = present(jax.sharding.get_abstract_mesh(), BATCH_AXES)
    head = model.lm_head.sharded(out.hidden, labels, keep, token_axes=axes,
                                 temperature=temperature,
                                 with_entropy=with_entropy, bucket=bucket)
    return head, out.aux_loss


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
      mesh: the ``models.mesh`` mesh over all global devices.
      sharded: more than one device (else the steps run exactly as without a mesh).
      params: parameter key -> ``NamedSharding``.
      replicated, batch: ``NamedSharding`` s for replicated values and ``[B, ...]`` batches.
      batch_shards: how many shards the batch splits into.
    """

    def __init__(self, mesh, mdef: state.ModelDef):
        self.mesh = mesh
        self.sharded = mesh.size > 1
        self.replicated = NamedSharding(mesh, P())
        self.batch = batch_sharding(mesh)
        self.batch_shards = axis_size(mesh, BATCH_AXES)
        abstract = nnx.eval_shape(lambda: models.Transformer(mdef.cfg, rngs=nnx.Rngs(0)))
        shardings = models.state_shardings(nnx.state(abstract, nnx.Param), mesh)
        self.params = {state._key(p): v.get_value()
                       for p, v in nnx.to_flat_state(shardings)}
        self._shapes = {k: v.shape for k, v in mdef.abstract_params().items()}

    @classmethod
    def from_config(cls, cfg, mdef: state.ModelDef) -> Placement:
        """The placement of ``cfg.mesh`` (absent: every device on ``data``).

        Raises:
          ValueError: axis sizes that do not multiply to the device count (both named).
        """
        mesh_cfg = cfg.get("mesh")
        return cls(make_mesh(None if mesh_cfg is None else mesh_cfg.to_dict()), mdef)

    # -- state -----------------------------------------------------------------------

    def opt_shardings(self, opt_state):
        """Shardings of an optimiser state (arrays or ``ShapeDtypeStruct`` s): a leaf
        under a parameter's key with that parameter's shape is placed like it (Adam's
        moments), anything else (counters) is replicated."""
        def leaf(path, x):
            for k in reversed(path):
                key = getattr(k, "key", None)
                if key in self.params and tuple(x.shape) == tuple(self._shapes[key]):
                    return self.params[key]
            return self.replicated

        return jax.tree_util.tree_map_with_path(leaf, opt_state)

    def abstract_state(self, tx, abstract_params) -> dict:
        """``{"params", "opt_state"}`` as ``ShapeDtypeStruct`` s with their target
        shardings: restore targets for ``Checkpointer.restore``."""
        def with_sharding(tree, shardings):
            return jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                tree, shardings)

        opt = jax.eval_shape(tx.init, abstract_params)
        return {"params": with_sharding(abstract_params, self.params),
                "opt_state": with_sharding(opt, self.opt_shardings(opt))}

    def place_params(self, params: state.Params) -> state.Params:
        """``params`` in their mesh layout (a no-op for arrays already there)."""
        if not self.sharded:
            return params
        return {k: _global(v, self.params[k]) for k, v in params.items()}

    def init_opt(self, tx, params):
        """``tx.init(params)`` created directly in its sharded layout."""
        if not self.sharded:
            return tx.init(params)
        shardings = self.opt_shardings(jax.eval_shape(tx.init, params))
        return jax.jit(tx.init, out_shardings=shardings)(params)

    # -- batches -----------------------------------------------------------------------

    def row_multiple(self, multiple: int) -> int:
        """A packed batch's row multiple that also splits over the batch shards."""
        return math.lcm(max(1, multiple), self.batch_shards) if self.sharded else multiple

    def device_batch(self, packed, *value_names: str) -> dict[str, jax.Array]:
        """``train.steps.device_batch`` split over the batch axes: every process holds
        the same global ``packed``; each device gets its rows.

        Raises:
          ValueError: rows not divisible by the batch shards (both numbers named).
        """
        from train import steps

        if not self.sharded:
            return steps.device_batch(packed, *value_names)
        host = {k: getattr(packed, k) for k in steps.BATCH_KEYS}
        host.update({k: packed.values[k] for k in value_names})
        check_divisible(packed.tokens.shape[0], self.mesh)
        def put(v):
            v = np.asarray(v)
            return jax.make_array_from_callback(v.shape, self.batch, lambda idx: v[idx])

        return {k: put(v) for k, v in host.items()}

    def bucket(self, packed, multiple: int) -> int:
        """The head's static bucket: ``packed.bucket`` on one device; on a mesh the rung
        of the fullest token shard (``jaxhead.bucket_for_shards``; every process holds
        the same global batch, so no collective is needed)."""
        if not self.sharded:
            return packed.bucket(multiple)
        keep = np.asarray(packed.loss_mask) != 0
        return jaxhead.bucket_for_shards(keep, self.batch_shards, multiple=multiple)


def jit_step(fn: Callable, placement: Placement | None, out_shardings=None, *,
             in_shardings=None, **jit_kwargs):
    """``jax.jit(fn, **jit_kwargs)``; with a multi-device ``placement``, compiled with
    ``in_shardings`` / ``out_shardings`` (callables of the placement, None: the inputs'
    own layout) and traced and run under ``jax.set_mesh`` (``models.jit_sharded``)."""
    if placement is None or not placement.sharded:
        return jax.jit(fn, **jit_kwargs)
    if in_shardings is not None:
        jit_kwargs["in_shardings"] = in_shardings(placement)
    if out_shardings is not None:
        jit_kwargs["out_shardings"] = out_shardings(placement)
    return models.jit_sharded(fn, placement.mesh, **jit_kwargs)


def update_shardings(tx):
    """``out_shardings`` of an update step ``-> (params, opt_state, metrics)``."""
    def out(p: Placement):
        opt = jax.eval_shape(tx.init, {k: jax.ShapeDtypeStruct(s, np.float32)
                                       for k, s in p._shapes.items()})
        return p.params, p.opt_shardings(opt), p.replicated

    return out


def initial_params(cfg, s, placement: Placement) -> state.Params:
    """``train.setup.initial_params`` in the placement's layout: a random init created
    sharded, a warm-start checkpoint restored into the shardings, HF weights placed."""
    from train import setup
    from train.checkpoint import require_checkpoint

    if not placement.sharded:
        return setup.initial_params(cfg, s)
    if cfg.init.sft_checkpoint:
        ckpt = require_checkpoint(cfg.init.sft_checkpoint)
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=placement.params[k])
                    for k, v in s.mdef.abstract_params().items()}
        return ckpt.restore({"params": abstract})[0]["params"]
    if s.hf_params is not None:
        return placement.place_params(s.hf_params)
    mdef, seed = s.mdef, cfg.seed
    init = jax.jit(lambda: state.params_of(models.Transformer(mdef.cfg, rngs=nnx.Rngs(seed))),
                   out_shardings=placement.params)
    with jax.set_mesh(placement.mesh):
        return init()
