"""Checkpoints with orbax ``CheckpointManager``: params, optimiser state, RNG key (arrays)
and step, data position and anything else JSON-able (metadata).

Orbax writes each step into a temporary directory and renames it when complete, so
``latest_step()`` only ever names a complete checkpoint: after a SIGKILL the job resumes
from the last one that finished, and a writer removes unfinished temporaries when it opens
the directory. It removes them itself, before returning: orbax's own cleanup
(``cleanup_tmp_directories``) runs in a background thread that ``close()`` does not wait
for, and a process that exits while it runs (an error right after opening) prints a
traceback from the interpreter's shutdown. Read-only views never remove anything.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    """Save every ``every`` steps (and whenever ``force``), keep the last ``keep``.

    Args:
      directory: where step directories go (created).
      every: save interval in steps.
      keep: how many recent checkpoints to keep.
      read_only: a view that restores and lists steps only: it neither creates the
        directory nor removes anything in it, and ``save`` raises.
    """

    def __init__(self, directory, every: int = 1, keep: int | None = None, *,
                 read_only: bool = False):
        self.directory = Path(directory).absolute()
        self.read_only = read_only
        # not orbax's read_only option, which logs a warning at every open: a view keeps
        # every step (max_to_keep=None) and its own save() refuses
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=max(1, every), max_to_keep=None if read_only else keep,
            create=not read_only, cleanup_tmp_directories=False,
            enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        if not read_only and jax.process_index() == 0:
            for name in ocp.path.step.tmp_checkpoints(self.directory):
                shutil.rmtree(self.directory / name)

    def latest_step(self) -> int | None:
        """The step of the latest complete checkpoint, or None."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        """The steps of every complete checkpoint, ascending."""
        return sorted(self._manager.all_steps())

    def has_item(self, step: int, name: str) -> bool:
        """Whether the checkpoint of ``step`` holds the item ``name`` (e.g. ``opt_state``;
        orbax writes each item of a step into its own subdirectory)."""
        return (self.directory / str(step) / name).is_dir()

    def save(self, step: int, items: dict[str, Any], meta: dict, *, force: bool = False
             ) -> bool:
        """Save the pytrees ``items`` (name -> pytree of arrays, e.g. params, opt_state,
        rng) and ``meta`` (JSON) at ``step`` if the interval says so or ``force``; returns
        whether it saved. Blocks until written.

        Raises:
          ValueError: the checkpointer is a read-only view (its directory named).
        """
        if self.read_only:
            raise ValueError(f"{self.directory} is open read-only: cannot save step {step}")
        if jax.process_count() > 1:  # arrays of one process only: saved from the host
            items = jax.tree.map(
                lambda x: np.asarray(x) if isinstance(x, jax.Array) and x.is_fully_addressable
                else x, items)
        args = {name: ocp.args.StandardSave(tree) for name, tree in items.items()}
        saved = self._manager.save(
            step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **args), force=force)
        self._manager.wait_until_finished()
        return saved

    def restore(self, abstract_items: dict[str, Any], step: int | None = None
                ) -> tuple[dict[str, Any], dict]:
        """``(items, meta)`` of ``step`` (default: the latest). Only the items named in
        ``abstract_items`` are read, each shaped like its pytree of arrays or
        ``jax.ShapeDtypeStruct``; a leaf with a ``sharding`` is restored in that layout
        (a checkpoint written on another device count or number of processes restores
        into the current mesh), a NumPy leaf as a NumPy array.

        Raises:
          FileNotFoundError: no complete checkpoint in the directory (named).
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
        args = {
            name: ocp.args.StandardRestore(jax.tree.map(_target, tree))
            for name, tree in abstract_items.items()
        }
        out = self._manager.restore(
            step, args=ocp.args.Composite(meta=ocp.args.JsonRestore(), **args))
        return {name: out[name] for name in abstract_items}, dict(out["meta"])

    def close(self) -> None:
        self._manager.close()


def _target(x):
    """Restore target of a leaf: NumPy as NumPy, else shape, dtype and its sharding if any
    (a ``NamedSharding``; a single-device array's own placement is not kept)."""
    if isinstance(x, np.ndarray):
        return x
    sharding = getattr(x, "sharding", None)
    keep = isinstance(sharding, jax.sharding.NamedSharding)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding if keep else None)


def check_resumable(directory, steps: int) -> None:
    """Raise unless a stage of ``steps`` steps can resume from ``directory``: its latest
    checkpoint must hold the optimiser state unless the stage already reached ``steps``
    (a finished stage that kept its final parameters only, ``train.run.loop.Stage``).

    Raises:
      ValueError: the directory, its last step and the way out named.
    """
    path = Path(directory)
    if not path.is_dir():
        return
    ckpt = Checkpointer(path, read_only=True)
    try:
        latest = ckpt.latest_step()
        if latest is not None and latest < steps and not ckpt.has_item(latest, "opt_state"):
            raise ValueError(
                f"{path} finished at step {latest} and kept its final parameters only; it "
                f"cannot be resumed to {steps} steps: use another workdir (or start from "
                f"those parameters with init.sft_checkpoint={str(path)!r})")
    finally:
        ckpt.close()


def require_checkpoint(directory) -> Checkpointer:
    """A read-only view of an existing checkpoint directory (e.g. an SFT warm start); the
    caller closes it.

    Raises:
      FileNotFoundError: the directory does not exist or holds no complete checkpoint.
    """
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    ckpt = Checkpointer(path, read_only=True)
    if ckpt.latest_step() is None:
        ckpt.close()
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} holds no complete "
                                "checkpoint")
    return ckpt
