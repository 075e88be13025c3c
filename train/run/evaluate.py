"""Held-out evaluation: mean reward at the sampling temperature, greedy accuracy and the
policy's probability of the reference answer, each with its standard error, and the
paired before/after comparison."""

from __future__ import annotations

import dataclasses
import json
import math
import time

import jax
import numpy as np
from tqdm import tqdm

from train.data.tasks import Problem, Tasks
from train.rl import packing, rollout
from train.rl.placement import place_batch
from train.rl.state import Params
from train.run import resume, setup


@dataclasses.dataclass
class EvalResult:
    """Per-problem results on one eval set.

    Attributes:
      sampled: float ``[n, k]`` rewards of ``k`` completions per problem at the sampling
        temperature (what GRPO optimises).
      greedy_correct: float ``[n]``: 1 where the greedy completion's task score is 1
        (exactly right).
      temperature: the sampling temperature.
      answer_prob: float ``[n]``: the policy's probability (at ``temperature``) of the
        reference answer's completion tokens (``answer_logprobs``): the expected reward
        of a sampled completion counted on the reference spelling only, without sampling
        noise; empty when not measured.
    """

    sampled: np.ndarray
    greedy_correct: np.ndarray
    temperature: float
    answer_prob: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

    @staticmethod
    def _mean_se(x: np.ndarray) -> tuple[float, float]:
        return float(x.mean()), float(x.std(ddof=1) / math.sqrt(len(x)))

    def sampled_reward(self) -> tuple[float, float]:
        """``(mean, standard error)``; the SE is over problems (each problem's mean over
        its k samples is one observation)."""
        return self._mean_se(self.sampled.mean(axis=1))

    def greedy_accuracy(self) -> tuple[float, float]:
        return self._mean_se(self.greedy_correct)

    def answer_probability(self) -> tuple[float, float]:
        return self._mean_se(self.answer_prob)

    def to_json(self) -> dict:
        return {"sampled": self.sampled.tolist(), "greedy_correct": self.greedy_correct.tolist(),
                "temperature": self.temperature, "answer_prob": self.answer_prob.tolist()}

    @classmethod
    def from_json(cls, d: dict) -> EvalResult:
        return cls(np.asarray(d["sampled"], np.float64),
                   np.asarray(d["greedy_correct"], np.float64), float(d["temperature"]),
                   np.asarray(d.get("answer_prob", []), np.float64))


def _generate_all(generate: rollout.Generator, params, prompts, key, batch: int, bar,
                  temperature: float, group: int = 1) -> list[tuple[rollout.Rollout, int]]:
    """``group`` completions of every prompt (consecutive rows), ``batch`` rows per call
    (the last call padded by repeating a prompt, so one shape compiles; each prompt
    prefilled once per call when ``group`` divides ``batch``, else repeated ``group``
    times); ``bar`` advances by one per call. The rows and their keys do not depend on
    ``group``."""
    if batch % group:
        prompts, group = [p for p in prompts for _ in range(group)], 1
    out, per_call = [], batch // group
    for start in range(0, len(prompts), per_call):
        chunk = list(prompts[start:start + per_call])
        n = len(chunk)
        chunk += [chunk[0]] * (per_call - n)
        ro = generate(params, chunk, jax.random.fold_in(key, start * group),
                      temperature=temperature, group_size=group)
        ro = ro._replace(prompt_routes=None, routes=None)  # an MoE's routes: not kept
        out += [(ro, i) for i in range(n * group)]
        bar.update(1)
    return out


def evaluate(generate: rollout.Generator, params: Params, problems: list[Problem],
             tasks: Tasks, *, temperature: float, samples: int, batch: int,
             key: jax.Array, format_weight: float = 0.0, progress: str | None = None
             ) -> EvalResult:
    """Sample ``samples`` completions per problem at ``temperature`` and one greedy one.

    Rewards are ``tasks.reward`` of each completion as its row ended (task score plus
    ``format_weight`` for a well-formed answer; a row cut by the budget scored on what it
    wrote); greedy correctness is a task score of 1. ``generate`` decodes (its
    ``max_new_tokens`` and stop tokens); ``batch`` rows per call. ``progress``: the label
    of a progress bar over the generation calls (None: no bar).
    """
    prompts = [p.prompt for p in problems]
    calls = -(-len(prompts) * samples // batch) + -(-len(problems) // batch)
    with tqdm(total=calls, desc=progress, disable=progress is None, unit="batch",
              leave=False) as bar:
        done = _generate_all(generate, params, prompts, key, batch, bar, temperature,
                             samples)
        greedy = _generate_all(generate, params, prompts, key, batch, bar, 0.0)
    rewards = [tasks.reward(problems[j // samples], ro.completion(i), bool(ro.stopped[i]),
                            format_weight) for j, (ro, i) in enumerate(done)]
    return EvalResult(np.asarray(rewards, np.float64).reshape(len(problems), samples),
                      _exactly_right(problems, greedy, tasks), temperature)


def _exactly_right(problems: list[Problem], completions, tasks: Tasks) -> np.ndarray:
    """float64 ``[n]``: 1 where problem ``j``'s completion (``completions[j]``, a
    ``(rollout, row)``) has a task score of 1."""
    return np.asarray([float(tasks.reward(p, ro.completion(i), bool(ro.stopped[i])) >= 1.0)
                       for p, (ro, i) in zip(problems, completions, strict=True)], np.float64)


def greedy_point(cfg, s: setup.Setup, generate: rollout.Generator, params: Params,
                 step: int) -> None:
    """One point of the held-out greedy-accuracy curve: the greedy completions of the first
    ``eval.curve_size`` held-out problems under ``params``, written as the metrics record
    ``kind="eval_greedy"`` of ``step`` (``greedy_accuracy``, its standard error,
    ``problems``; ``train.run.plot`` draws them). A resumed run that redoes the step writes
    nothing twice (``MetricsWriter``)."""
    problems = s.eval_problems[:cfg.eval.curve_size]
    batch = cfg.eval.batch or s.rollout.rows
    with tqdm(total=-(-len(problems) // batch), disable=True) as bar:
        greedy = _generate_all(generate, params, [p.prompt for p in problems],
                               jax.random.key(0), batch, bar, 0.0)
    acc, se = EvalResult._mean_se(_exactly_right(problems, greedy, s.tasks))
    s.writer.write(step, {"greedy_accuracy": acc, "greedy_accuracy_se": se,
                          "problems": len(problems)}, kind="eval_greedy")


def answer_logprobs(logprobs, params: Params, problems: list[Problem], tasks: Tasks, *,
                    row_len: int, row_multiple: int, batch: int, place, bucket) -> np.ndarray:
    """``log P(reference answer | prompt)`` of each problem: the sum of the log-probs of
    its completion ``tasks.target_ids(answer)`` (the answer's tokens and the end token,
    as SFT trains them) under ``params``, teacher-forced, float64 ``[n]``.

    Args:
      logprobs: ``(params, batch, bucket) -> [R, L]`` log-probs of the kept tokens
        (``train.rl.steps.reference_logprobs``, at the sampling temperature).
      row_len, row_multiple, batch: packed row length, the row count's multiple (fewer
        distinct shapes to compile) and problems per call.
      place: ``packing.PackedBatch -> device batch`` (``train.rl.placement.place_batch``).
      bucket: ``packing.PackedBatch -> int``: the head's bucket of a packed batch.
    """
    out = np.zeros(len(problems))
    for start in range(0, len(problems), batch):
        chunk = problems[start:start + batch]
        packed = packing.pack([p.prompt for p in chunk],
                              [tasks.target_ids(p.answer) for p in chunk], row_len,
                              row_multiple=row_multiple)
        logp = np.asarray(jax.device_get(logprobs(params, place(packed), bucket(packed))))
        scored = packed.seq_index >= 0
        out[start:start + len(chunk)] = np.bincount(
            packed.seq_index[scored], weights=logp[scored], minlength=len(chunk))
    return out


def paired_change(before: np.ndarray, after: np.ndarray) -> tuple[float, float]:
    """Mean and standard error of ``after - before`` per problem (same problems)."""
    d = np.asarray(after, np.float64) - np.asarray(before, np.float64)
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(len(d)))


def report(before: EvalResult, after: EvalResult, title: str) -> str:
    """The before/after table: means ± standard errors, the change ± its paired SE and the
    change in units of the larger of the two unpaired SEs' combination
    ``sqrt(se_before^2 + se_after^2)`` (a conservative test)."""
    rows = []
    pairs = [(f"sampled reward (T={after.temperature:g})", before.sampled.mean(axis=1),
              after.sampled.mean(axis=1)),
             ("greedy accuracy", before.greedy_correct, after.greedy_correct)]
    if before.answer_prob.size and after.answer_prob.size:
        pairs.append((f"P(reference answer) (T={after.temperature:g})", before.answer_prob,
                      after.answer_prob))
    for name, b, a in pairs:
        (mb, sb), (ma, sa) = EvalResult._mean_se(b), EvalResult._mean_se(a)
        d, sd = paired_change(b, a)
        unpaired = math.hypot(sb, sa)
        rows.append(f"| {name} | {mb:.4f} ± {sb:.4f} | {ma:.4f} ± {sa:.4f} | "
                    f"{d:+.4f} ± {sd:.4f} | {d / unpaired if unpaired else float('nan'):+.1f} |")
    head = ("| metric | before GRPO | after GRPO | change (paired SE) | "
            "change / unpaired SE |\n|---|---|---|---|---|")
    return f"{title}\n{head}\n" + "\n".join(rows)


def held_out(cfg, s: setup.Setup, generate: rollout.Generator, logprobs, params, name: str,
             step: int) -> EvalResult:
    """Evaluate ``params`` on the held-out set, or load the saved result ``name``. The
    same key is used before and after GRPO (common random numbers: the paired difference
    has less noise). ``logprobs``: the run's jitted teacher-forced log-probs
    (``train.rl.steps.reference_logprobs`` at the sampling temperature), built once so that
    both evaluations share its compiles."""
    path = s.workdir / f"eval_{name}.json"
    if path.exists():
        return EvalResult.from_json(json.loads(path.read_text()))
    t0 = time.perf_counter()
    res = evaluate(
        generate, params, s.eval_problems, s.tasks,
        temperature=s.rollout.temperature, samples=cfg.eval.samples,
        batch=cfg.eval.batch or s.rollout.rows,
        key=jax.random.fold_in(jax.random.key(cfg.seed), 10**6),
        format_weight=cfg.data.format_reward,
        progress=f"eval {name}" if s.writer.enabled else None)
    placement = s.placement
    res.answer_prob = np.exp(answer_logprobs(
        logprobs, params, s.eval_problems, s.tasks, row_len=cfg.train.row_len,
        row_multiple=placement.row_multiple(cfg.train.row_multiple),
        batch=s.rollout.rows,
        place=lambda packed: place_batch(packed.arrays(), placement.mesh),
        bucket=lambda packed: placement.bucket(packed, cfg.train.bucket_multiple)))
    if s.writer.enabled:
        resume.write_atomic(path, json.dumps(res.to_json()))
    (r, r_se), (a, a_se), (q, q_se) = (res.sampled_reward(), res.greedy_accuracy(),
                                       res.answer_probability())
    s.writer.write(step, {"sampled_reward": r, "sampled_reward_se": r_se, "greedy_accuracy": a,
                          "greedy_accuracy_se": a_se, "answer_prob": q, "answer_prob_se": q_se,
                          "seconds": time.perf_counter() - t0},
                   kind=f"eval_{name}")
    return res


def summary(res: EvalResult, n: int, label: str) -> str:
    """One line: ``label``, the ``n`` held-out problems, the sampled reward and the greedy
    accuracy with their standard errors."""
    (r, r_se), (a, a_se) = res.sampled_reward(), res.greedy_accuracy()
    return (f"{label}: {n} held-out problems: sampled reward (T={res.temperature:g}) "
            f"{r:.4f} ± {r_se:.4f}, greedy accuracy {a:.4f} ± {a_se:.4f}")
