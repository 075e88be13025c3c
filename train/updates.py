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
equal shape whose gradients are summed inside the step (``train.steps.grpo_step``), each
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

from train import packing, rl_loss, steps
from train.placement import Placement, place_batch, to_host

#: ``loss.old_logprobs`` values (module docstring).
OLD_LOGPROBS = ("sampler", "trainer")
_SHUFFLE_STREAM = 1 << 30  # fold_in offset of the shuffles: far from the decode steps


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The updates of one step (module docstring).

    Attributes:
      epochs: passes over the rollout (``train.updates_per_batch``).
      mini_batches: optimizer steps per pass (``train.mini_batches``).
      micro_batches: parts each step's gradient is accumulated over (``train.micro_batches``).
      old_logprobs: one of ``OLD_LOGPROBS`` (``loss.old_logprobs``).
    """

    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    old_logprobs: str = "sampler"

    @classmethod
    def from_config(cls, cfg) -> Schedule:
        """The schedule of ``cfg.train`` / ``cfg.loss``.

        Raises:
          ValueError: a count that is not a positive integer, ``rollout.prompts_per_step``
            not divisible by ``train.mini_batches``, or an unknown ``loss.old_logprobs``
            (each naming the key and the value).
        """
        t = cfg.train
        mini = _positive_int("train.mini_batches", t.mini_batches)
        prompts = cfg.rollout.prompts_per_step
        if prompts % mini:
            raise ValueError(f"train.mini_batches={mini} must divide "
                             f"rollout.prompts_per_step={prompts} (groups are kept whole)")
        if cfg.loss.old_logprobs not in OLD_LOGPROBS:
            raise ValueError(f"loss.old_logprobs must be one of {OLD_LOGPROBS}, got "
                             f"{cfg.loss.old_logprobs!r}")
        return cls(_positive_int("train.updates_per_batch", t.updates_per_batch), mini,
                   _positive_int("train.micro_batches", t.micro_batches),
                   cfg.loss.old_logprobs)

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


def loss_config(cfg) -> rl_loss.LossConfig:
    """The ``rl_loss.LossConfig`` of ``cfg.loss``.

    Raises:
      ValueError: see ``rl_loss.LossConfig.check``.
    """
    c = cfg.loss
    return rl_loss.LossConfig(
        eps_low=c.eps_low, eps_high=c.eps_high, beta=c.beta, kl_estimator=c.kl_estimator,
        entropy_coef=c.entropy_coef, aggregation=c.aggregation,
        max_completion_len=cfg.rollout.max_new_tokens, tis_cap=c.tis_cap,
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
    """

    prompts: list
    completions: list
    values: dict[str, list[np.ndarray]]
    group_size: int

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
                            values={k: [v[i] for i in ids] for k, v in self.values.items()})


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


class Updater:
    """The updates of one GRPO step (module docstring), with the jitted update and forward
    it owns for the run.

    Args:
      mdef, tx, loss_cfg, placement, temperature, skip, frozen: as
        ``train.steps.grpo_step``.
      schedule: ``Schedule``.
      row_len: tokens per packed row.
      row_multiple: each micro-batch's row count is a multiple of this (already a
        multiple of the placement's batch shards).
      bucket_multiple: the head's bucket ladder.
    """

    def __init__(self, mdef, tx, loss_cfg: rl_loss.LossConfig, placement: Placement,
                 schedule: Schedule, *, temperature: float, skip: bool,
                 frozen: tuple[str, ...], row_len: int, row_multiple: int,
                 bucket_multiple: int):
        self.loss, self.placement, self.schedule = loss_cfg, placement, schedule
        self.skip, self.row_len = skip, row_len
        self.row_multiple, self.bucket_multiple = row_multiple, bucket_multiple
        # sampler log-probs with a correction over several epochs: the trainer's are
        # recorded at a token's first update (NaN until then: rl_loss uses its own)
        self.first_visit = (schedule.old_logprobs == "sampler" and loss_cfg.corrects_mismatch
                            and schedule.epochs > 1)
        self.step = steps.grpo_step(mdef, tx, loss_cfg, placement, temperature=temperature,
                                    skip=skip, frozen=frozen, return_logp=self.first_visit)
        self.forward = steps.reference_logprobs(mdef, placement, temperature=temperature,
                                                skip=skip)

    def _max_kept(self, piece: packing.PackedBatch) -> int:
        """The most positions ``piece`` can keep: its sequences x the longest completion."""
        seqs = np.unique(piece.seq_index[piece.seq_index >= 0]).size
        return max(seqs, 1) * self.loss.max_completion_len

    def _place(self, piece: packing.PackedBatch) -> dict:
        return place_batch(piece.arrays(*piece.values), self.placement.mesh)

    def layout(self, seqs: Sequences, key: jax.Array):
        """``(ids, packs, pieces, bucket)`` of a step: the completions of each mini-batch
        ``ids[epoch][m]``, its packing ``packs[epoch][m]`` (one epoch only when there is
        one mini-batch: every epoch is the same batch), its micro-batches
        ``pieces[epoch][m][u]`` (row slices, all of one shape) and the head's bucket they
        all use (None without ``skip``: the head runs on every position)."""
        sched, micro = self.schedule, self.schedule.micro_batches
        ids = [[seqs.members(g) for g in epoch]
               for epoch in sched.mini_batch_groups(seqs.num_groups, key)]
        distinct = ids if sched.mini_batches > 1 else ids[:1]
        unit = micro * self.row_multiple
        need = max(seqs.rows_needed(i, self.row_len) for epoch in distinct for i in epoch)
        rows = -(-need // unit) * unit
        packs = [[seqs.pack(i, self.row_len, rows) for i in epoch] for epoch in distinct]
        r = rows // micro
        pieces = [[[p.rows(u * r, (u + 1) * r) for u in range(micro)] for p in epoch]
                  for epoch in packs]
        every = [x for epoch in pieces for mini in epoch for x in mini]
        # never more slots than a piece's completions can fill (its sequences x the
        # longest completion): full-length completions fill the bucket exactly
        bucket = (max(self.placement.bucket(x, self.bucket_multiple, self._max_kept(x))
                      for x in every) if self.skip else None)
        return ids, packs, pieces, bucket

    def __call__(self, params, opt_state, seqs: Sequences, key: jax.Array,
                 ref_params=None) -> tuple[object, object, StepReport]:
        """Run the step's updates on ``seqs`` (``key``: the step's PRNG key, for the
        shuffles; ``ref_params``: the reference policy, needed when ``loss.beta > 0``).
        Returns ``(params, opt_state, StepReport)``; ``params`` and ``opt_state`` are
        donated."""
        t0 = time.perf_counter()
        sched, micro = self.schedule, self.schedule.micro_batches
        ids, packs, pieces, bucket = self.layout(seqs, key)
        repacked = len(packs) > 1  # later epochs packed differently: values per completion
        placed, refs, carried = self._first_epoch(params, ref_params, ids[0], packs[0],
                                                  pieces[0], bucket, repacked)
        t1 = time.perf_counter()
        reports = []
        for epoch in range(sched.epochs):
            for m in range(sched.mini_batches):
                packed = packs[epoch if repacked else 0][m]
                if epoch and repacked:
                    batches, ref = self._later(packed, pieces[epoch][m], ids[epoch][m],
                                               carried)
                else:
                    batches, ref = placed[m], refs and refs[m]
                norm = None if micro == 1 else rl_loss.LossNorm.of(
                    packed.loss_mask, packed.seq_index, packed.num_seqs, packed.segment_ids)
                args = ((batches[0], ref and ref[0]) if micro == 1 else
                        (tuple(batches), ref and tuple(ref)))
                out = self.step(params, opt_state, *args, packed.num_seqs, bucket, norm)
                params, opt_state, metrics = out[:3]
                if self.first_visit and epoch == 0:  # the trainer's log-probs, first seen
                    logps = out[3] if micro > 1 else (out[3],)
                    if repacked:
                        carried.setdefault("trainer_logp", {}).update(
                            self._per_completion([ids[0][m]], [packed], [logps]))
                    else:  # the later epochs run on these very batches
                        for b, logp in zip(placed[m], logps, strict=True):
                            b["trainer_logp"] = logp
                reports.append(((epoch + 1, m + 1), metrics))
        reports = jax.device_get(reports)  # waits for the updates
        t2 = time.perf_counter()
        first = [x for mini in pieces[0] for x in mini]
        report = StepReport(
            reports, first[0].tokens.shape[0], self.skip, bucket,
            positions=sum(x.loss_mask.size for x in first),
            kept=sum(x.num_kept for x in first),
            real=sum(int(np.count_nonzero(x.segment_ids)) for x in first),
            head_tokens=(bucket if self.skip else first[0].loss_mask.size) * len(first),
            seconds={"reference": t1 - t0, "train": t2 - t1})
        return params, opt_state, report

    def _first_epoch(self, params, ref_params, ids, packs, pieces, bucket, repacked):
        """Epoch 1's micro-batches on the devices with the forwards before the first
        update: ``(placed[m][u], refs[m][u] | None, carried)``, ``carried`` the
        trainer-side values per completion for the later epochs when they are packed
        differently (``repacked``)."""
        placed = [[self._place(x) for x in mini] for mini in pieces]
        refs = None
        if self.loss.beta > 0:
            refs = [[self.forward(ref_params, b, bucket) for b in mini] for mini in placed]
        for b in (b for mini in placed for b in mini):
            if self.schedule.old_logprobs == "trainer":
                b["trainer_logp"] = self.forward(params, b, bucket)
            elif self.first_visit:
                b["trainer_logp"] = self._place_array(
                    np.full(b["loss_mask"].shape, np.nan, np.float32))
        jax.block_until_ready((placed, refs))
        carried: dict[str, dict[int, np.ndarray]] = {}
        if repacked and refs is not None:
            carried["ref_logp"] = self._per_completion(ids, packs, refs)
        if repacked and self.schedule.old_logprobs == "trainer":
            carried["trainer_logp"] = self._per_completion(
                ids, packs, [[b["trainer_logp"] for b in mini] for mini in placed])
        return placed, refs, carried

    def _place_array(self, x: np.ndarray):
        return place_batch({"x": x}, self.placement.mesh)["x"]

    @staticmethod
    def _per_completion(ids, packs, arrays) -> dict[int, np.ndarray]:
        """Completion index -> its tokens' values, from the micro-batch arrays
        ``arrays[m][u]`` of mini-batches ``packs[m]`` holding completions ``ids[m]``."""
        out = {}
        for mini_ids, packed, parts in zip(ids, packs, arrays, strict=True):
            whole = np.concatenate([np.asarray(a) for a in to_host(list(parts))])
            for k, v in zip(mini_ids, packed.per_sequence(whole), strict=True):
                out[int(k)] = v
        return out

    def _later(self, packed, pieces, ids, carried) -> tuple[list[dict], list | None]:
        """A later epoch's micro-batches of mini-batch ``packed`` (completions ``ids``)
        with the carried values placed in its packing; and the reference's log-probs."""
        batches = [self._place(x) for x in pieces]
        refs = None
        r = pieces[0].tokens.shape[0]
        for name, store in carried.items():
            whole = packed.place([store[int(i)] for i in ids])
            parts = [self._place_array(whole[u * r:(u + 1) * r]) for u in range(len(pieces))]
            if name == "ref_logp":
                refs = parts
            else:
                for b, x in zip(batches, parts, strict=True):
                    b[name] = x
        return batches, refs
