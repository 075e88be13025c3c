"""Nothing non-finite ever reaches the parameters: a NaN log-prob (an invalid label under
``jit``), a NaN ratio or a NaN gradient skips the update, leaving the parameters and the
optimizer state as they were; ``train.rl.nonfinite.Guard`` names each skipped update with its
step and cause and stops the run after ``max_nonfinite_updates`` in a row; a non-finite
reward is an error naming the task and the problem."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from configs import grpo_micro
from models import get_config
from tests.support.models import random_model
from train.rl import nonfinite, packing, rl_loss, steps
from train.rl.placement import place_batch
from train.rl.state import ModelDef, params_of
from train.run import experience, grpo_stage, setup
from train.run.loop import Loop


@pytest.fixture(scope="module")
def tiny():
    """A tiny decoder, its jitted GRPO step and one packed batch (random completions)."""
    cfg = get_config("tiny", dtype="float32")
    mdef, params = ModelDef.of(cfg), params_of(random_model(cfg, seed=4))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(10, 500, 5).tolist() for _ in range(4)]
    comps = [rng.integers(10, 500, 6).tolist() for _ in range(4)]
    packed = packing.pack(prompts, comps, 32, row_multiple=2, values={
        "old_logp": [-rng.uniform(1, 6, 6) for _ in comps],
        "advantages": [np.full(6, a, np.float32) for a in (1.0, -1.0, 0.5, -0.5)]})
    tx = optax.adam(1e-3)
    step = steps.grpo_step(mdef, tx, rl_loss.LossConfig(max_completion_len=6),
                           temperature=1.0)
    return mdef, params, tx, step, packed


def _run(tiny, change=None):
    _, params, tx, step, packed = tiny
    b = place_batch(packed.arrays("old_logp", "advantages"))
    if change:
        b = change(b)
    before = jax.tree.map(np.asarray, (params, tx.init(params)))
    out = step(jax.tree.map(jnp.copy, params), tx.init(params), (b,), None, packed.num_seqs,
               packed.bucket(16))
    return before, jax.tree.map(np.asarray, out[:2]), jax.device_get(out[2])


def _first_completion_token(b):
    return tuple(int(i[0]) for i in np.nonzero(np.asarray(b["loss_mask"]) > 0))


@pytest.mark.parametrize("cause", ["logprob", "ratio", "finite"])
def test_a_non_finite_update_leaves_parameters_and_optimizer_state_as_they_were(tiny, cause):
    def change(b):
        r, t = _first_completion_token(b)
        if cause == "logprob":  # a label outside [0, V) under jit: NaN log-prob, NaN grads
            b["labels"] = b["labels"].at[r, t].set(tiny[0].cfg.vocab_size)
        elif cause == "ratio":  # the sampler's log-prob of a token NaN
            b["old_logp"] = b["old_logp"].at[r, t].set(jnp.nan)
        return b

    before, after, m = _run(tiny, change)
    moved = [not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(after),
                                                         jax.tree.leaves(before), strict=True)]
    if cause == "finite":
        assert float(m["skipped"]) == 0 and any(moved)
        assert all(float(m[f"nonfinite_{c}"]) == 0 for c in nonfinite.CAUSES)
        return
    assert float(m["skipped"]) == 1 and not any(moved)  # bit for bit
    assert float(m[f"nonfinite_{cause}"]) == 1
    if cause == "ratio":
        assert float(m["nonfinite_logprob"]) == 0


def test_the_guard_names_each_skip_and_stops_after_the_limit(capsys):
    guard = nonfinite.Guard(3, "grpo")
    ok = {"skipped": 0.0}

    def bad(**causes):
        return {"skipped": 1.0, **{f"nonfinite_{c}": 1.0 for c in causes}}

    assert guard.observe(4, [("1.1", bad(ratio=1, loss=1)), ("1.2", dict(ok))]) == 1
    assert guard.observe(5, [("1.1", bad(gradient=1)), ("1.2", bad(logprob=1))]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("warning: grpo step 4, update 1.1: non-finite ratio, loss: update "
                      "skipped (1 in a row, the run stops at 3)")
    assert err[2].startswith("warning: grpo step 5, update 1.2: non-finite log-prob")
    m = bad(gradient=1)
    with pytest.raises(nonfinite.NonFiniteError,
                       match=r"^grpo step 6: non-finite gradient; 3 updates in a row"):
        guard.observe(6, [("", m)])
    assert m == {}  # the flags leave the metrics line
    with pytest.raises(ValueError, match="max_nonfinite_updates = 0: must be an integer >= 1"):
        nonfinite.Guard(0, "sft")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    cfg = grpo_micro.get_config()
    cfg.workdir = str(tmp_path_factory.mktemp("nonfinite"))
    cfg.metrics.tensorboard = False
    cfg.train.updates_per_batch = 2
    cfg.train.optim.warmup_steps = 0
    s = setup.build(cfg)
    stream = s.tasks.train_stream(1, s.exclude)
    problems = [next(stream)[1] for _ in range(cfg.rollout.prompts_per_step)]
    return cfg, s, s.placement.init_params(0), problems


def test_the_run_stops_after_the_configured_count_naming_the_cause(run, monkeypatch):
    """Every sampler log-prob NaN: each update of the step is skipped; with a limit of 3
    the step reports 2 skipped updates and unchanged parameters, with a limit of 2 the
    run stops naming the ratio."""
    cfg, s, params, problems = run
    real = grpo_stage.rollout_sequences

    def nan_logprobs(*args):
        seqs = real(*args)
        seqs.values["old_logp"] = [np.full_like(v, np.nan) for v in seqs.values["old_logp"]]
        return seqs

    monkeypatch.setattr(grpo_stage, "rollout_sequences", nan_logprobs)
    cfg.train.max_nonfinite_updates = 3
    loop = Loop(cfg, s, grpo_stage.stage(cfg))
    it = grpo_stage.GRPOIteration(cfg, s, loop, experience.generator(s), None)
    got, _, metrics = it(jax.tree.map(jnp.copy, params), loop.tx.init(params), problems,
                         jax.random.key(0), 1)
    assert metrics()["nonfinite_updates"] == 2
    assert all(np.array_equal(got[k], params[k]) for k in params)
    it.guard = nonfinite.Guard(2, "grpo")  # the same compiled step, a limit of 2
    with pytest.raises(nonfinite.NonFiniteError, match=r"^grpo step 1, update 2\.1: non-finite "
                                                       r"ratio, loss, gradient, update; 2 updates"):
        it(jax.tree.map(jnp.copy, params), loop.tx.init(params), problems, jax.random.key(0), 1)


def test_a_non_finite_reward_names_the_task_and_the_problem(run, monkeypatch):
    _, s, _, problems = run
    p = problems[0]
    ds = s.tasks.dataset(p.task, 0)
    monkeypatch.setattr(type(ds), "score_answer", lambda self, answer, entry: float("nan"))
    with pytest.raises(ValueError, match=r"task 'chain_sum' scored a non-finite reward nan "
                                         r"for the problem '.*' with the answer '7'"):
        s.tasks.reward(p, s.tokenizer.encode("7</answer>"), False)  # after "<answer>"
