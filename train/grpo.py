"""GRPO on reasoning-gym tasks: ``python -m train.grpo --config=configs/grpo_tiny.py``.

One run, in ``cfg.workdir``:

1. warm start: the SFT stage (``train.sft``, when ``sft.steps > 0``; resumed or just
   loaded if it already ran), else ``init.sft_checkpoint``, an HF checkpoint or a random
   init;
2. held-out evaluation of the warm start (saved, so a resumed run does not redo it);
3. ``train.steps`` GRPO steps: G completions for each of P prompts sampled with the KV
   cache (jaxhead's chunked Gumbel-max, sampler log-probs recorded), rewards from the
   task's ``score_answer``, group advantages, packed rows, the frozen reference's
   log-probs when ``loss.beta > 0``, one clipped-surrogate update; metrics every step,
   checkpoints every ``checkpoint.every`` steps and at the end;
4. held-out evaluation of the final policy and the before/after table.

Rerunning the same command resumes from the latest complete checkpoint.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, logging
from tqdm import tqdm

from train import cli, distributed, evaluate, packing, rl_loss, rollout, setup, steps
from train.checkpoint import Checkpointer
from train.metrics import MetricsWriter, peak_flops, peak_memory_bytes, train_step_flops
from train.optim import frozen_prefixes, make_optimizer
from train.sft import run_sft

GRPO_DIR = "grpo"


def loss_config(cfg) -> rl_loss.LossConfig:
    c = cfg.loss
    return rl_loss.LossConfig(
        eps_low=c.eps_low, eps_high=c.eps_high, beta=c.beta, kl_estimator=c.kl_estimator,
        entropy_coef=c.entropy_coef, aggregation=c.aggregation,
        max_completion_len=cfg.rollout.max_new_tokens)


def _atomic_json(path, obj) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def held_out(cfg, s: setup.Setup, params, name: str, writer: MetricsWriter, step: int
             ) -> evaluate.EvalResult:
    """Evaluate ``params`` on the held-out set, or load the saved result ``name``. The
    same key is used before and after GRPO (common random numbers: the paired difference
    has less noise)."""
    path = s.workdir / f"eval_{name}.json"
    if path.exists():
        return evaluate.EvalResult.from_json(json.loads(path.read_text()))
    t0 = time.perf_counter()
    res = evaluate.evaluate(
        s.mdef, params, s.eval_problems, s.tasks, s.tokenizer,
        temperature=cfg.rollout.temperature, samples=cfg.eval.samples,
        max_new_tokens=cfg.rollout.max_new_tokens,
        batch=cfg.eval.batch or cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        key=jax.random.fold_in(jax.random.key(cfg.seed), 10**6),
        format_weight=cfg.data.format_reward)
    if writer.enabled:
        _atomic_json(path, res.to_json())
    (r, r_se), (a, a_se) = res.sampled_reward(), res.greedy_accuracy()
    writer.write(step, {"sampled_reward": r, "sampled_reward_se": r_se, "greedy_accuracy": a,
                        "greedy_accuracy_se": a_se, "seconds": time.perf_counter() - t0},
                 kind=f"eval_{name}")
    return res


def _summary(res: evaluate.EvalResult, n: int, label: str) -> str:
    (r, r_se), (a, a_se) = res.sampled_reward(), res.greedy_accuracy()
    return (f"{label}: {n} held-out problems: sampled reward (T={res.temperature:g}) "
            f"{r:.4f} ± {r_se:.4f}, greedy accuracy {a:.4f} ± {a_se:.4f}")


def rollout_batch(cfg, s: setup.Setup, params, problems, key):
    """Sample G completions per problem; returns ``(rollout, rewards [P, G], correct
    [P, G])``."""
    g = cfg.rollout.group_size
    prompts = [p.prompt for p in problems for _ in range(g)]
    ro = rollout.generate(
        s.mdef, params, prompts, key, max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
        stop_ids=s.tasks.stop_ids, num_valid=s.tokenizer.num_valid)
    rewards, correct = [], []
    for i in range(len(prompts)):
        text = evaluate.completion_text(s.tokenizer, ro, i)
        p = problems[i // g]
        rewards.append(s.tasks.reward(p, text, cfg.data.format_reward))
        correct.append(float(s.tasks.reward(p, text) >= 1.0))
    shape = (len(problems), g)
    return ro, np.reshape(rewards, shape), np.reshape(correct, shape)


def pack_rollout(cfg, problems, ro: rollout.Rollout, advantages: np.ndarray,
                 row_multiple: int) -> packing.PackedBatch:
    """Pack prompt + completion per row of the rollout with the sampler log-probs
    (``old_logp``) and the completion's advantage on each of its tokens; the row count is
    a multiple of ``row_multiple``."""
    g = cfg.rollout.group_size
    n = len(problems) * g
    comps = [ro.completion(i) for i in range(n)]
    adv = advantages.reshape(-1)
    return packing.pack(
        [problems[i // g].prompt for i in range(n)], comps, cfg.train.row_len,
        row_multiple=row_multiple,
        values={"old_logp": [ro.logprobs[i, : len(c)] for i, c in enumerate(comps)],
                "advantages": [np.full(len(c), adv[i], np.float32) for i, c in enumerate(comps)]})


def train(cfg, s: setup.Setup, writer: MetricsWriter, start_params,
          placement: distributed.Placement | None = None) -> tuple:
    """The GRPO loop (resumed from ``<workdir>/grpo`` if it has a checkpoint). Returns the
    final params. ``placement``: the mesh (``train.distributed``; None: from ``cfg.mesh``)."""
    placement = placement or distributed.Placement.from_config(cfg, s.mdef)
    total = cfg.train.steps
    tx, lr = make_optimizer(cfg.train.optim, total)
    lcfg = loss_config(cfg)
    skip = cfg.train.skip_unkept
    ckpt = Checkpointer(s.workdir / GRPO_DIR, cfg.checkpoint.every, cfg.checkpoint.keep)
    key = jax.random.key(cfg.seed)
    abstract = s.mdef.abstract_params()
    latest = ckpt.latest_step()
    ref_params = start_params if lcfg.beta > 0 else None
    if latest is None:
        params = jax.tree.map(jnp.copy, start_params)  # the step donates its params
        opt_state, position, first = placement.init_opt(tx, params), 0, 1
    else:
        items, meta = ckpt.restore({
            **placement.abstract_state(tx, abstract),
            "rng": {"key": np.asarray(jax.random.key_data(key))}})
        params, opt_state = items["params"], items["opt_state"]
        key = jax.random.wrap_key_data(items["rng"]["key"])
        position, first = meta["data_position"], meta["step"] + 1
        print(f"grpo: resuming from checkpoint step {meta['step']}", flush=True)
    stream = s.tasks.train_stream(cfg.data.train_seed, s.exclude, start=position)
    row_multiple = placement.row_multiple(cfg.train.row_multiple)  # rows split over shards
    step_fn = steps.grpo_step(s.mdef, tx, lcfg, cfg.rollout.temperature, skip,
                              frozen_prefixes(cfg.train.optim), placement)
    ref_fn = steps.reference_logprobs(s.mdef, cfg.rollout.temperature, skip, placement)
    peak = peak_flops(cfg.metrics.peak_flops)
    bar = tqdm(total=total, initial=first - 1, desc="grpo", disable=not writer.enabled)
    for step in range(first, total + 1):
        t0 = time.perf_counter()
        batch = [next(stream) for _ in range(cfg.rollout.prompts_per_step)]
        position = batch[-1][0]
        problems = [p for _, p in batch]
        ro, rewards, correct = rollout_batch(cfg, s, params, problems,
                                             jax.random.fold_in(key, step))
        t1 = time.perf_counter()
        adv = rl_loss.group_advantages(rewards, cfg.loss.advantage)
        packed = pack_rollout(cfg, problems, ro, adv, row_multiple)
        b = placement.device_batch(packed, "old_logp", "advantages")
        bucket = placement.bucket(packed, cfg.train.bucket_multiple) if skip else 0
        ref = None
        if lcfg.beta > 0:
            ref = jax.block_until_ready(ref_fn(ref_params, b, bucket))
        t2 = time.perf_counter()
        params, opt_state, m = step_fn(params, opt_state, b, ref, packed.num_seqs, bucket)
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        t3 = time.perf_counter()
        if step % cfg.train.log_every == 0 or step == total:
            real = int(np.count_nonzero(packed.segment_ids))
            head_tokens = bucket if skip else packed.loss_mask.size
            flops = train_step_flops(s.mdef.cfg, real, head_tokens,
                                     context=real / max(packed.num_seqs, 1) / 2)
            writer.write(step, {
                **m, "reward_mean": rewards.mean(), "reward_std": rewards.std(),
                "accuracy": correct.mean(),
                "zero_std_group_fraction": float(np.mean(rewards.std(axis=1) == 0)),
                "completion_length_mean": float(ro.lengths.mean()),
                "completion_length_max": float(ro.lengths.max()),
                "stop_fraction": float(ro.stopped.mean()),
                "lr": float(lr(step - 1)),
                "lm_head_token_fraction": packed.num_kept / packed.loss_mask.size,
                "lm_head_bucket_fraction": head_tokens / packed.loss_mask.size,
                "tokens_per_s": real / (t3 - t0), "train_tokens_per_s": real / (t3 - t2),
                "mfu": flops / (t3 - t2) / peak,
                "peak_memory_bytes": peak_memory_bytes(),
                "time_rollout_s": t1 - t0, "time_reference_s": t2 - t1,
                "time_train_s": t3 - t2, "sampling_path": ro.path,
                "skipped_prompts": s.tasks.skipped,
            })
            bar.set_postfix(reward=f"{rewards.mean():.3f}", acc=f"{correct.mean():.3f}")
        ckpt.save(step, {"params": params, "opt_state": opt_state,
                         "rng": {"key": np.asarray(jax.random.key_data(key))}},
                  {"step": step, "data_position": position}, force=step == total)
        bar.update(1)
    bar.close()
    ckpt.close()
    return params


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    t_start = time.perf_counter()
    cfg = cli.config()
    distributed.initialize(cfg)  # before any other JAX call
    s = setup.build_or_exit(cfg)
    placement = distributed.Placement.from_config(cfg, s.mdef)
    writer = MetricsWriter(s.workdir / "metrics.jsonl", enabled=jax.process_index() == 0,
                           tensorboard=cfg.metrics.tensorboard)
    if cfg.sft.steps > 0 and not cfg.init.sft_checkpoint:
        start = run_sft(cfg, s, writer, placement)
    else:
        start = distributed.initial_params(cfg, s, placement)
    n = len(s.eval_problems)
    before = None
    if cfg.eval.before_after:
        before = held_out(cfg, s, start, "before", writer, 0)
        print(_summary(before, n, "before GRPO"), flush=True)
    params = train(cfg, s, writer, start, placement)
    if before is not None:
        after = held_out(cfg, s, params, "after", writer, cfg.train.steps)
        print(_summary(after, n, "after GRPO"), flush=True)
        title = (f"tasks {cfg.data.tasks}: {n} held-out problems (question texts never in "
                 f"training), {cfg.eval.samples} samples each at T={cfg.rollout.temperature:g}"
                 f", {cfg.train.steps} GRPO steps")
        print(evaluate.report(before, after, title), flush=True)
    cpu = sum(os.times()[:2])  # user + system seconds of this process
    print(f"prompts skipped as too long: {s.tasks.skipped}; wall time "
          f"{time.perf_counter() - t_start:.0f} s (CPU time {cpu:.0f} s); run directory "
          f"{s.workdir}", flush=True)
    writer.close()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
