"""The training loop both stages share (``train.sft``, ``train.grpo``).

``Loop`` owns what does not depend on the algorithm: the optimiser of the stage's
``optim`` section, the checkpoint directory ``<workdir>/<stage>`` and resuming from its
latest complete checkpoint (parameters, optimiser state, RNG key, step, data position),
the training stream of problems from the saved position, the progress bar, the periodic
metrics lines and checkpoints, and the checkpoint at the end. The algorithm is an
``Iteration``: one step's work on a batch of problems.

A resumed run redoes the steps after its checkpoint with the same data (the position)
and the same randomness (the key), so it produces the same numbers; ``MetricsWriter``
never writes a step's line twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from train.data.tasks import Problem, training_seed
from train.rl.optim import applied_rate, at_step, frozen_prefixes, make_optimizer
from train.rl.state import Params
from train.run.checkpoint import Checkpointer, check_resumable
from train.run.metrics import peak_memory_bytes
from train.run.setup import Setup

#: ``(params, opt_state, metrics)`` of one step; ``metrics()`` is called on logging
#: steps only (it may read device values back and time the step).
StepResult = tuple[Params, object, Callable[[], dict]]


class Iteration(Protocol):
    def __call__(self, params: Params, opt_state, problems: list[Problem], key: jax.Array,
                 step: int) -> StepResult:
        """One training step on ``problems`` with the step's PRNG ``key``."""


@dataclasses.dataclass(frozen=True)
class Stage:
    """What the loop needs to know of a stage.

    Attributes:
      name: ``"sft"`` / ``"grpo"``: the checkpoint directory under the workdir, the
        progress bar's label and the ``kind`` of the metrics lines (``"train"`` for GRPO).
      steps: total steps (step numbers run from 1 to ``steps``).
      batch: problems drawn from the training stream per step.
      log_every: write metrics every this many steps (and at the last).
      optim: the stage's ``optim`` config section (``train.rl.optim.make_optimizer``).
      kind: the metrics lines' ``kind``.
      postfix: metric names shown on the progress bar.
      final_params_only: the last checkpoint holds the parameters only (no optimiser
        state, no RNG key): for a stage another stage continues from, whose finished
        state nothing but its parameters is read from (the SFT stage of ``train.grpo``).
      updates_per_step: optimizer updates each step makes (GRPO: ``updates_per_batch x
        mini_batches``); the learning-rate schedule still counts steps
        (``train.rl.optim.make_optimizer``).
    """

    name: str
    steps: int
    batch: int
    log_every: int
    optim: object
    kind: str
    postfix: tuple[str, ...] = ()
    final_params_only: bool = False
    updates_per_step: int = 1


class Loop:
    """The loop of one stage of a run (see the module docstring).

    Attributes:
      tx, schedule: the optimiser (``make_optimizer(stage.optim, stage.steps,
        stage.updates_per_step)``) and its learning rate per step: before step ``s`` the
        loop sets the rate's position to ``s`` (``train.rl.optim.at_step``), so every update
        of the step applies ``schedule(s - 1)`` whatever earlier updates were skipped, and
        the ``lr`` logged is the rate the step's last applied update used, read from the
        optimizer state (``train.rl.optim.applied_rate``); created once; the stage builds its
        jitted step with ``tx``.
      frozen: the stage's frozen parameter-name prefixes (``optim.frozen``).
    """

    def __init__(self, cfg, s: Setup, stage: Stage):
        self.cfg, self.s, self.stage = cfg, s, stage
        self.tx, self.schedule = make_optimizer(stage.optim, stage.steps,
                                                 stage.updates_per_step)
        self.frozen = frozen_prefixes(stage.optim)
        self.directory = s.workdir / stage.name

    def _checkpointer(self) -> Checkpointer:
        c = self.cfg.checkpoint
        return Checkpointer(self.directory, c.every, c.keep)

    def finished_params(self) -> Params | None:
        """The final parameters if this stage already ran to its last step, else None."""
        ckpt = self._checkpointer()
        try:
            latest = ckpt.latest_step()
            if latest is None or latest < self.stage.steps:
                return None
            return ckpt.restore({"params": self.s.placement.abstract_params()})[0]["params"]
        finally:
            ckpt.close()

    def _restore(self, ckpt: Checkpointer, step: int, key: jax.Array) -> tuple[dict, dict]:
        """The items and metadata of checkpoint ``step`` to resume from.

        Raises:
          ValueError: its optimizer state has another layout than ``self.tx``'s (written
            by a version of the trainer whose optimizer state differs): the directory,
            the step and the way out named (its parameters still restore).
        """
        try:
            return ckpt.restore({**self.s.placement.abstract_state(self.tx),
                                 "rng": {"key": np.asarray(jax.random.key_data(key))}})
        except ValueError as err:
            if "structure" not in str(err).lower():
                raise
            raise ValueError(
                f"{self.directory}: the optimizer state of checkpoint step {step} has another "
                f"layout than this trainer's ({str(err).splitlines()[0][:160]}); it cannot be "
                f"resumed: use "
                f"another workdir, starting from its parameters with "
                f"init.sft_checkpoint={str(self.directory)!r}") from err

    def run(self, start: Callable[[], Params], iteration: Iteration) -> Params:
        """Run the stage from its latest checkpoint (or from ``start()``'s parameters) to
        its last step; returns the final parameters.

        ``start`` is only called when there is no checkpoint; its arrays are not
        donated (the steps donate their inputs, so they get a copy).

        Raises:
          ValueError: the stage's latest checkpoint holds final parameters only (it
            finished with ``final_params_only``) but the stage has more steps now
            (``train.run.checkpoint.check_resumable``; ``setup.build`` checks it first), or
            an optimizer state of another layout (``_restore``).
        """
        cfg, s, stage, placement = self.cfg, self.s, self.stage, self.s.placement
        done = self.finished_params()
        if done is not None:
            if s.writer.enabled:
                print(f"{stage.name}: finished earlier ({stage.steps} steps); using its final "
                      f"checkpoint in {self.directory}", flush=True)
            return done
        check_resumable(self.directory, stage.steps)
        ckpt = self._checkpointer()
        key = jax.random.key(cfg.seed)
        latest = ckpt.latest_step()
        if latest is None:
            params = jax.tree.map(jnp.copy, start())  # the steps donate their params
            opt_state, position, first = placement.init_opt(self.tx, params), 0, 1
        else:
            items, meta = self._restore(ckpt, latest, key)
            params, opt_state = items["params"], items["opt_state"]
            key = jax.random.wrap_key_data(items["rng"]["key"])
            position, first = meta["data_position"], meta["step"] + 1
            print(f"{stage.name}: resuming from checkpoint step {meta['step']}", flush=True)
        tasks = s.stage_tasks(stage.name)
        stream = tasks.train_stream(training_seed(cfg.data.train_seed, cfg.seed), s.exclude,
                                    start=position)
        bar = tqdm(total=stage.steps, initial=first - 1, desc=stage.name,
                   disable=not s.writer.enabled)
        for step in range(first, stage.steps + 1):
            drawn = [next(stream) for _ in range(stage.batch)]
            position = drawn[-1][0]
            # the rate's schedule position is the step, whatever updates were skipped
            opt_state = at_step(opt_state, step, stage.updates_per_step)
            params, opt_state, metrics = iteration(
                params, opt_state, [p for _, p in drawn], jax.random.fold_in(key, step), step)
            if step % stage.log_every == 0 or step == stage.steps:
                m = {**metrics(), "lr": applied_rate(opt_state),
                     "skipped_prompts": tasks.skipped, "peak_memory_bytes": peak_memory_bytes()}
                s.writer.write(step, m, kind=stage.kind)
                bar.set_postfix({k: f"{m[k]:.3f}" for k in stage.postfix})
            last = step == stage.steps
            items = {"params": params}
            if not (last and stage.final_params_only):
                items.update(opt_state=opt_state,
                             rng={"key": np.asarray(jax.random.key_data(key))})
            ckpt.save(step, items, {"step": step, "data_position": position}, force=last)
            bar.update(1)
        bar.close()
        ckpt.close()
        return params
