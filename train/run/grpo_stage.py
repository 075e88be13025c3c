"""The GRPO stage of a run: ``stage`` (what the loop sees), ``GRPOIteration`` (one GRPO
step: the rollout, its rewards, the group advantages, the updates of
``train.rl.updates``, the step's metrics) and ``train_grpo`` (the stage resumed from its
checkpoint and run to its last step). ``train.grpo`` runs it between the held-out
evaluations."""

from __future__ import annotations

import time

from train.rl import nonfinite, rl_loss, rollout, updates
from train.rl.rollout_settings import RolloutSettings
from train.rl.state import Params
from train.run import evaluate, setup
from train.run.experience import generator, rollout_sequences, score
from train.run.loop import Loop, Stage
from train.run.metrics import grpo_metrics, peak_flops, train_step_flops


def stage(cfg) -> Stage:
    """The GRPO stage of ``cfg`` (``cfg.train``, the rollouts' prompts a step) as the loop
    sees it."""
    t = cfg.train
    prompts = RolloutSettings.from_config(cfg).prompts_per_step
    return Stage(setup.GRPO_DIR, t.steps, prompts, t.log_every, t.optim,
                 kind="train", postfix=("reward_mean", "accuracy"),
                 updates_per_step=t.updates_per_batch * t.mini_batches)


class GRPOIteration:
    """One GRPO step (a ``train.run.loop.Iteration``), with the jitted functions it owns for
    the whole run: the sampler and the updates (``train.rl.updates.Updater``: the update
    step and the forward of the reference and of the old policy).

    Args:
      cfg, s: the run's config and setup.
      loop: the stage's loop (its optimiser builds the update).
      generate: the run's sampler (``generator(s)``).
      ref_params: the frozen reference policy (needed when ``loss.beta > 0``).

    Raises:
      ValueError: a bad ``train.updates_per_batch`` / ``mini_batches`` / ``micro_batches``
        or ``loss.old_logprobs`` (``train.rl.updates.Schedule.from_config``), or loss setting
        (``train.rl.updates.loss_config``).
    """

    def __init__(self, cfg, s: setup.Setup, loop: Loop, generate: rollout.Generator,
                 ref_params: Params | None):
        self.cfg, self.s, self.generate, self.ref_params = cfg, s, generate, ref_params
        self.schedule = updates.Schedule.from_config(cfg)
        self.skip = cfg.train.skip_unkept
        self.updater = updates.Updater(
            s.mdef, loop.tx, updates.loss_config(cfg.loss, s.rollout.max_new_tokens),
            s.placement, self.schedule,
            temperature=s.rollout.temperature, skip=self.skip, frozen=loop.frozen,
            row_len=cfg.train.row_len,
            row_multiple=s.placement.row_multiple(cfg.train.row_multiple),
            bucket_multiple=cfg.train.bucket_multiple,
            routing_replay=cfg.loss.routing_replay)
        self.peak = peak_flops(cfg.metrics.peak_flops)
        self.guard = nonfinite.Guard(cfg.train.max_nonfinite_updates, "grpo",
                                     s.writer.enabled)

    def __call__(self, params, opt_state, problems, key, step):
        cfg, s = self.cfg, self.s
        t0 = time.perf_counter()
        # 1. G completions per prompt from the current policy (each prompt prefilled once)
        ro = self.generate(params, [p.prompt for p in problems], key,
                           temperature=s.rollout.temperature, group_size=s.rollout.group_size)
        rewards, correct = score(cfg, s, problems, ro)  # 2. rewards
        t1 = time.perf_counter()
        adv = rl_loss.group_advantages(rewards, cfg.loss.advantage,  # 3. group advantages
                                        negative_weight=cfg.loss.negative_weight)
        seqs = rollout_sequences(cfg, s, problems, ro, adv)
        t2 = time.perf_counter()
        # 4. packed mini-batches, the reference's (loss.beta > 0) and the old policy's
        # log-probs, the clipped-surrogate updates
        params, opt_state, report = self.updater(params, opt_state, seqs, key,
                                                 self.ref_params)
        if (cfg.eval.before_after and cfg.eval.curve_every and s.eval_problems
                and step % cfg.eval.curve_every == 0):
            evaluate.greedy_point(cfg, s, self.generate, params, step)
        many = len(report.updates) > 1  # the updates named <epoch>.<mini-batch>
        skipped = self.guard.observe(step, [(f"{e}.{m}" if many else "", metrics)
                                            for (e, m), metrics in report.updates])

        def metrics():
            epochs = self.schedule.epochs
            flops = epochs * train_step_flops(s.mdef.cfg, report.real, report.head_tokens,
                                              context=report.real / len(seqs.prompts) / 2)
            times = {"rollout": t1 - t0, "reference": t2 - t1 + report.seconds["reference"],
                     "train": report.seconds["train"]}
            return {**grpo_metrics(report, rewards, correct, ro, epochs=epochs, times=times,
                                   flops=flops, peak=self.peak),
                    "nonfinite_updates": skipped}

        return params, opt_state, metrics


def train_grpo(cfg, s: setup.Setup, start_params: Params,
               generate: rollout.Generator | None = None) -> Params:
    """The GRPO stage (resumed from ``<workdir>/grpo`` if it has a checkpoint) from
    ``start_params``, which also serve as the reference policy; ``generate``: the run's
    sampler (None: a new one). Returns the final params."""
    loop = Loop(cfg, s, stage(cfg))
    generate = generate or generator(s)
    ref = start_params if cfg.loss.beta > 0 else None
    return loop.run(lambda: start_params, GRPOIteration(cfg, s, loop, generate, ref))
