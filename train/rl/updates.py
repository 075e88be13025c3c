"""The optimizer updates of one GRPO step: epochs over the rollout, mini-batches,
micro-batch gradient accumulation, and the old policy's log-probs.

A step's rollout holds ``P`` groups of ``G`` completions. ``Updater`` runs
``train.updates_per_batch`` epochs (DeepSeekMath's GRPO, arXiv:2402.03300, Algorithm 1:
``mu`` iterations of the objective per batch; PPO's K epochs; verl ``ppo_epochs``, Tunix
``num_iterations``, TRL ``num_iterations``) over it. Each epoch splits the groups into
``train.mini_batches`` equal mini-batches, each one optimizer step, drawn afresh every
epoch (a permutation from the step's PRNG key; with one mini-batch every epoch is the
same batch and nothing is shuffled).

Groups are kept whole in a mini-batch. The group-relative advantages are computed over
the whole rollout first, so no advantage depends on the split; but a group's advantages
sum to zero (its mean is the baseline), and a step that saw only part of a group would
push its completions up or down with no counterweight from the rest: its gradient would
carry the baseline's noise that the group was formed to cancel. Whole groups keep each
step's gradient a group-baselined estimate, as verl (``ppo_mini_batch_size`` counts
prompts, times ``rollout.n``) and Tunix (``mini_batch_size`` counts prompts) have it.

A mini-batch is packed into rows and split by rows into ``train.micro_batches`` parts of
equal shape whose gradients are summed inside the step (``train.rl.steps.grpo_step``), each
normalised over the whole mini-batch (``rl_loss.LossNorm``): the update does not depend
on the split. Every mini-batch of a step is packed into the same number of rows (the
most any needs, rounded up to ``micro_batches * row_multiple``) and every micro-batch
uses the same head bucket (the rung of the fullest), so one compiled update and one
compiled forward serve every update of a step; across steps the (rows, bucket) ladder
bounds the compiles as it does with one update.

The PPO ratio's old policy (``loss.old_logprobs``):

* ``"sampler"``: the rollout's own log-probs (no extra forward). With a mismatch
  correction (``loss.tis_cap``, ``loss.mask_ratio_*``), whose weights need the trainer's
  log-probs of the old policy, those come from the forward of the first update that sees
  a token (exact for the first mini-batch) and are kept for its later epochs.
* ``"trainer"``: the trainer's log-probs before the first update, one extra forward on the
  kept tokens of every micro-batch (as verl and Tunix recompute them); the corrections
  weigh the sampler's against them.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from train.config import domains as d
from train.rl import packing, rl_loss, steps
from train.rl.placement import Placement, place_batch, to_host

#: ``loss.old_logprobs``'s domain (module docstring).
OLD_LOGPROBS = d.one_of("sampler", "trainer")
#: The counts ``Schedule.from_config`` reads.
COUNTS = ("train.updates_per_batch", "train.mini_batches", "train.micro_batches")
_SHUFFLE_STREAM = 1 << 30  # fold_in offset of the shuffles: far from the decode steps


def whole_groups(cfg) -> list[tuple[str, str]]:
    """The relation of ``train.mini_batches`` to ``rollout.prompts_per_step`` (a config
    relation, ``train.run.schema.RELATIONS``): a mini-batch holds whole groups (module
    docstring), so the mini-batches divide the prompts."""
    prompts = cfg.rollout.prompts_per_step
    if prompts % cfg.train.mini_batches:
        why = f"must divide rollout.prompts_per_step ({prompts}): mini-batches hold whole groups"
        return [("train.mini_batches", why)]
    return []


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The updates of one step (module docstring).

    Attributes:
      epochs: passes over the rollout (``train.updates_per_batch``).
      mini_batches: optimizer steps per pass (``train.mini_batches``).
      micro_batches: parts each step's gradient is accumulated over (``train.micro_batches``).
      old_logprobs: in ``OLD_LOGPROBS`` (``loss.old_logprobs``).
    """

    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    old_logprobs: str = "sampler"

    @classmethod
    def from_config(cls, cfg) -> Schedule:
        """The schedule of ``cfg.train`` / ``cfg.loss``.

        Raises:
          ValueError: a count not in ``domains.COUNT``, an unknown ``loss.old_logprobs``,
            or ``rollout.prompts_per_step`` not divisible by ``train.mini_batches``
            (``whole_groups``), as the config check words it.
        """
        counts = [d.COUNT.require(key, d.value_at(cfg, key)) for key in COUNTS]
        old = OLD_LOGPROBS.require("loss.old_logprobs", cfg.loss.old_logprobs)
        d.enforce(cfg, [whole_groups])
        return cls(*counts, old)

    def mini_batch_groups(self, num_groups: int, key: jax.Array) -> list[list[np.ndarray]]:
        """``[epoch][mini-batch]``: the (sorted) group indices of each mini-batch."""
        if self.mini_batches == 1:
            return [[np.arange(num_groups)] for _ in range(self.epochs)]
        out = []
        for epoch in range(self.epochs):
            order = jax.random.permutation(jax.random.fold_in(key, _SHUFFLE_STREAM + epoch),
                                           num_groups)
            out.append([np.sort(part) for part in
                        np.split(np.asarray(order), self.mini_batches)])
        return out


def loss_config(loss, max_completion_len: int) -> rl_loss.LossConfig:
    """The ``rl_loss.LossConfig`` of the config section ``loss`` (``cfg.loss``) for
    completions of at most ``max_completion_len`` tokens (the rollouts' budget,
    ``RolloutSettings.max_new_tokens``).

    Raises:
      ValueError: see ``rl_loss.LossConfig.check``.
    """
    c = loss
    return rl_loss.LossConfig(
        eps_low=c.eps_low, eps_high=c.eps_high, beta=c.beta, kl_estimator=c.kl_estimator,
        entropy_coef=c.entropy_coef, aggregation=c.aggregation,
        max_completion_len=max_completion_len, tis_cap=c.tis_cap,
        mask_ratio_low=c.mask_ratio_low, mask_ratio_high=c.mask_ratio_high,
        clip_ratio_c=c.clip_ratio_c, ratio_level=c.ratio_level).check()


@dataclasses.dataclass
class Sequences:
    """A rollout's completions as packing takes them.

    Attributes:
      prompts, completions: token id lists, completion ``k`` after prompt ``k``; group
        ``g`` is completions ``g * group_size ... (g + 1) * group_size - 1``.
      values: name -> one float32 array per completion (its tokens' values: ``old_logp``,
        ``advantages``, ``min_logit``).
      group_size: completions per group.
      routes: None, or per sequence the sampler's experts of its prompt and completion
        tokens (``train.rl.rollout.Rollout.sequence_routes``), packed beside the tokens.
    """

    prompts: list
    completions: list
    values: dict[str, list[np.ndarray]]
    group_size: int
    routes: list[np.ndarray] | None = None

    @property
    def num_groups(self) -> int:
        return len(self.completions) // self.group_size

    def members(self, groups: np.ndarray) -> np.ndarray:
        """The completions of ``groups``, in order."""
        return (np.asarray(groups)[:, None] * self.group_size
                + np.arange(self.group_size)[None, :]).reshape(-1)

    def rows_needed(self, ids: np.ndarray, row_len: int) -> int:
        lengths = [len(self.prompts[i]) + len(self.completions[i]) for i in ids]
        return len(packing.assign_rows(lengths, row_len))

    def pack(self, ids: np.ndarray, row_len: int, num_rows: int) -> packing.PackedBatch:
        """Completions ``ids`` packed into ``num_rows`` rows (sequence ``k`` of the batch
        is completion ``ids[k]``)."""
        return packing.pack([self.prompts[i] for i in ids], [self.completions[i] for i in ids],
                            row_len, num_rows=num_rows,
                            values={k: [v[i] for i in ids] for k, v in self.values.items()},
                            routes=None if self.routes is None else
                            [self.routes[i] for i in ids])


@dataclasses.dataclass
class StepReport:
    """What one step's updates did.

    Attributes:
      updates: ``((epoch, mini-batch), metrics)`` of every update in order (host floats;
        both numbered from 1).
      rows: each micro-batch's rows.
      skip: whether the head ran on the kept tokens only (``train.skip_unkept``).
      bucket: each micro-batch's head bucket when ``skip``, else None (the head ran on
        every position).
      positions, kept, real: token positions, completion tokens and non-padding tokens
        of one epoch's batches.
      head_tokens: positions the head computed in one epoch's forwards.
      seconds: ``{"reference": packing and the forwards before the first update (the
        reference's, the old policy's), "train": the updates}``.
    """

    updates: list[tuple[tuple[int, int], dict]]
    rows: int
    skip: bool
    bucket: int | None
    positions: int
    kept: int
    real: int
    head_tokens: int
    seconds: dict[str, float]


@dataclasses.dataclass
class MiniBatch:
    """The batch of one optimizer update.

    Attributes:
      ids: the completions it holds (whole groups).
      packed: their packing.
      parts: its micro-batches: row slices of ``packed``, all of one shape.
      norm: the counts every part is normalised by (``rl_loss.LossNorm`` of ``packed``);
        None for one part (its own counts).
      batches: the parts on the devices with their ``trainer_logp`` when the loss takes
        one (None until placed).
      ref_logps: the reference's log-probs of each part (``loss.beta > 0``), or None.
    """

    ids: np.ndarray
    packed: packing.PackedBatch
    parts: list[packing.PackedBatch]
    norm: rl_loss.LossNorm | None
    batches: tuple[dict, ...] | None = None
    ref_logps: tuple | None = None


class Updater:
    """The updates of one GRPO step (module docstring), with the jitted update and forward
    it owns for the run.

    Args:
      mdef, tx, loss_cfg, placement, temperature, skip, frozen: as
        ``train.rl.steps.grpo_step``.
      schedule: ``Schedule``.
      row_len: tokens per packed row.
      row_multiple: each micro-batch's row count is a multiple of this (already a
        multiple of the placement's batch shards).
      bucket_multiple: the head's bucket ladder.
      routing_replay: the policy's forwards (the updates' and the old policy's) use the
        experts the sampler recorded (``train.rl.steps.grpo_step``); the reference model's
        routes its own.
    """

    def __init__(self, mdef, tx, loss_cfg: rl_loss.LossConfig, placement: Placement,
                 schedule: Schedule, *, temperature: float, skip: bool,
                 frozen: tuple[str, ...], row_len: int, row_multiple: int,
                 bucket_multiple: int, routing_replay: bool = False):
        self.loss, self.placement, self.schedule = loss_cfg, placement, schedule
        self.skip, self.row_len = skip, row_len
        self.row_multiple, self.bucket_multiple = row_multiple, bucket_multiple
        # where the PPO ratio's old policy comes from (module docstring): a forward before
        # the first update, or (sampler log-probs corrected over several epochs) the
        # update that first sees a token, NaN until then (rl_loss uses its own); else the
        # sampler's, nothing to record
        self.old_policy_forward = schedule.old_logprobs == "trainer"
        self.record_first_seen = (schedule.old_logprobs == "sampler"
                                  and loss_cfg.corrects_mismatch and schedule.epochs > 1)
        self.step = steps.grpo_step(mdef, tx, loss_cfg, placement, temperature=temperature,
                                    skip=skip, frozen=frozen,
                                    return_logp=self.record_first_seen,
                                    routing_replay=routing_replay)
        self.forward = steps.reference_logprobs(mdef, placement, temperature=temperature,
                                                skip=skip)
        self.old_forward = self.forward if not routing_replay else steps.reference_logprobs(
            mdef, placement, temperature=temperature, skip=skip, routing_replay=True)

    def _max_kept(self, piece: packing.PackedBatch) -> int:
        """The most positions ``piece`` can keep: its sequences x the longest completion."""
        seqs = np.unique(piece.seq_index[piece.seq_index >= 0]).size
        return max(seqs, 1) * self.loss.max_completion_len

    def _place(self, piece: packing.PackedBatch) -> dict:
        return place_batch(piece.arrays(*piece.values), self.placement.mesh)

    def layout(self, seqs: Sequences, key: jax.Array
               ) -> tuple[list[list[MiniBatch]], int | None]:
        """``(plan, bucket)`` of a step: ``plan[epoch][m]`` the ``MiniBatch`` of each update
        (with one mini-batch every epoch's is the same object: the same batch), and the
        head's bucket every micro-batch uses (None without ``skip``: the head runs on
        every position)."""
        sched, micro = self.schedule, self.schedule.micro_batches
        ids = [[seqs.members(g) for g in epoch]
               for epoch in sched.mini_batch_groups(seqs.num_groups, key)]
        distinct = ids if sched.mini_batches > 1 else ids[:1]
        unit = micro * self.row_multiple
        need = max(seqs.rows_needed(i, self.row_len) for epoch in distinct for i in epoch)
        rows = -(-need // unit) * unit
        r = rows // micro

        def mini_batch(i):
            p = seqs.pack(i, self.row_len, rows)
            norm = None if micro == 1 else rl_loss.LossNorm.of(
                p.loss_mask, p.seq_index, p.num_seqs, p.segment_ids)
            return MiniBatch(i, p, [p.rows(u * r, (u + 1) * r) for u in range(micro)], norm)

        plan = [[mini_batch(i) for i in epoch] for epoch in distinct]
        every = [x for epoch in plan for mb in epoch for x in mb.parts]
        # never more slots than a piece's completions can fill (its sequences x the
        # longest completion): full-length completions fill the bucket exactly
        bucket = (max(self.placement.bucket(x, self.bucket_multiple, self._max_kept(x))
                      for x in every) if self.skip else None)
        return plan * (sched.epochs // len(plan)), bucket

    def __call__(self, params, opt_state, seqs: Sequences, key: jax.Array,
                 ref_params=None) -> tuple[object, object, StepReport]:
        """Run the step's updates on ``seqs`` (``key``: the step's PRNG key, for the
        shuffles; ``ref_params``: the reference policy, needed when ``loss.beta > 0``).
        Returns ``(params, opt_state, StepReport)``; ``params`` and ``opt_state`` are
        donated.

        DeepSeekMath's GRPO (Algorithm 1) for one batch of rollouts: the reference's and
        the old policy's log-probs, then ``mu`` epochs over the batch, each a pass over
        its mini-batches, each one optimizer update whose gradient is accumulated over
        its micro-batches (inside the jitted step)."""
        t0 = time.perf_counter()
        plan, bucket = self.layout(seqs, key)
        carried = self._before_updates(params, ref_params, plan, bucket)
        t1 = time.perf_counter()
        reports = []
        for epoch, minis in enumerate(plan, 1):
            for m, mb in enumerate(minis, 1):
                if mb.batches is None:  # a later epoch's reshuffled mini-batch
                    self._place_carried(mb, carried)
                params, opt_state, metrics, *logps = self.step(
                    params, opt_state, mb.batches, mb.ref_logps, mb.packed.num_seqs, bucket,
                    mb.norm)
                if logps and epoch == 1:  # the trainer's log-probs of the rollout policy
                    self._record_first_seen(mb, logps[0], carried)
                reports.append(((epoch, m), metrics))
        reports = jax.device_get(reports)  # waits for the updates
        t2 = time.perf_counter()
        first = [x for mb in plan[0] for x in mb.parts]
        report = StepReport(
            reports, first[0].tokens.shape[0], self.skip, bucket,
            positions=sum(x.loss_mask.size for x in first),
            kept=sum(x.num_kept for x in first),
            real=sum(int(np.count_nonzero(x.segment_ids)) for x in first),
            head_tokens=(bucket if self.skip else first[0].loss_mask.size) * len(first),
            seconds={"reference": t1 - t0, "train": t2 - t1})
        return params, opt_state, report

    def _before_updates(self, params, ref_params, plan, bucket) -> dict | None:
        """Place epoch 1's mini-batches with the forwards before the first update (the
        reference's; the old policy's with ``loss.old_logprobs="trainer"``; NaN for the
        log-probs recorded at a token's first update). Returns the values later epochs
        carry per completion (name -> completion -> its tokens' values) when they are
        packed afresh (reshuffled mini-batches), else None."""
        for mb in plan[0]:
            mb.batches = tuple(self._place(x) for x in mb.parts)
            if self.loss.beta > 0:
                mb.ref_logps = tuple(self.forward(ref_params, b, bucket) for b in mb.batches)
            for b in mb.batches:
                if self.old_policy_forward:
                    b["trainer_logp"] = self.old_forward(params, b, bucket)
                elif self.record_first_seen:
                    b["trainer_logp"] = self._place_array(
                        np.full(b["loss_mask"].shape, np.nan, np.float32))
        jax.block_until_ready([(mb.batches, mb.ref_logps) for mb in plan[0]])
        if all(mb.batches is not None for epoch in plan for mb in epoch):
            return None
        carried: dict[str, dict[int, np.ndarray]] = {}
        for mb in plan[0]:
            if mb.ref_logps is not None:
                carried.setdefault("ref_logp", {}).update(
                    self._per_completion(mb, mb.ref_logps))
            if self.old_policy_forward:
                carried.setdefault("trainer_logp", {}).update(
                    self._per_completion(mb, [b["trainer_logp"] for b in mb.batches]))
        return carried

    def _record_first_seen(self, mb: MiniBatch, logps, carried: dict | None) -> None:
        """Keep the trainer's log-probs of ``mb``'s tokens before its first update: on its
        batches (the later epochs of one mini-batch run on them) and per completion when
        later epochs are packed afresh."""
        for b, logp in zip(mb.batches, logps, strict=True):
            b["trainer_logp"] = logp
        if carried is not None:
            carried.setdefault("trainer_logp", {}).update(self._per_completion(mb, logps))

    def _place_array(self, x: np.ndarray):
        return place_batch({"x": x}, self.placement.mesh)["x"]

    @staticmethod
    def _per_completion(mb: MiniBatch, arrays) -> dict[int, np.ndarray]:
        """Completion index -> its tokens' values, from the arrays of ``mb``'s parts."""
        whole = np.concatenate([np.asarray(a) for a in to_host(list(arrays))])
        return {int(k): v for k, v in zip(mb.ids, mb.packed.per_sequence(whole), strict=True)}

    def _place_carried(self, mb: MiniBatch, carried: dict) -> None:
        """Place a later epoch's mini-batch ``mb`` with the carried values in its packing."""
        mb.batches = tuple(self._place(x) for x in mb.parts)
        r = mb.parts[0].tokens.shape[0]
        for name, store in carried.items():
            whole = mb.packed.place([store[int(i)] for i in mb.ids])
            parts = tuple(self._place_array(whole[u * r:(u + 1) * r])
                          for u in range(len(mb.parts)))
            if name == "ref_logp":
                mb.ref_logps = parts
            else:
                for b, x in zip(mb.batches, parts, strict=True):
                    b[name] = x
