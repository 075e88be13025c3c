"""Processes: JAX's multi-controller runtime (``jax.distributed``) for runs on several hosts.

``train.sft`` / ``train.grpo`` read the config section ``distributed``
(``train.run.schema``): ``coordinator_address`` / ``num_processes`` / ``process_id`` (empty:
the ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` environment
variables; none of them set: one process), or ``enabled=True`` for
``jax.distributed.initialize()``'s own cluster detection (Cloud TPU pod slices, SLURM,
Open MPI, Kubernetes). ``initialize(cfg)`` runs before any other JAX call.

Where arrays live once the processes are up (the mesh, parameters, optimiser state,
batches) is ``train.rl.placement``.
"""

from __future__ import annotations

import os

import jax

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
    ``(process index, process count)`` (``(0, 1)`` without touching JAX for one process)."""
    d = cfg.get("distributed")
    if d is None:
        return 0, 1
    explicit = bool(d.coordinator_address) or d.num_processes > 0 or d.process_id >= 0
    if not (explicit or d.enabled or any(k in os.environ for k in _ENV)):
        return 0, 1
    return initialize_distributed(d.coordinator_address or None, d.num_processes or None,
                                  None if d.process_id < 0 else d.process_id)
