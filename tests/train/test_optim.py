"""Optimiser options: frozen parameters and per-prefix learning-rate multipliers."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import pytest

from train.rl.optim import frozen_prefixes, lr_multipliers, make_optimizer
from train.run.schema import base_config


def test_frozen_and_lr_multipliers():
    c = base_config().train.optim
    c.warmup_steps, c.decay = 0, "constant"
    c.frozen, c.lr_multipliers = ("embed_tokens",), (("norm", 30),)
    tx, _ = make_optimizer(c, 10)
    params = {"embed_tokens.embedding": jnp.ones(4), "norm.scale": jnp.ones(4),
              "layers.0.norm.scale": jnp.ones(4), "normal.w": jnp.ones(4)}
    state = tx.init(params)
    updates, _ = tx.update({k: jnp.full(4, 0.01) for k in params}, state, params)
    step = {k: float(-v[0]) for k, v in updates.items()}
    assert step["embed_tokens.embedding"] == 0.0
    assert step["norm.scale"] == pytest.approx(30 * c.lr, rel=1e-3)
    # prefixes match whole dotted components only
    assert step["layers.0.norm.scale"] == pytest.approx(c.lr, rel=1e-3)
    assert step["normal.w"] == pytest.approx(c.lr, rel=1e-3)


def test_bad_lr_multipliers_raise():
    c = base_config().train.optim
    c.lr_multipliers = ("norm",)
    with pytest.raises(ValueError, match=r"optim.lr_multipliers = \('norm',\): must be a tuple of \(parameter-name prefix, multiplier > 0\) pairs"):
        lr_multipliers(c)
    c.lr_multipliers = (("norm", "x"),)
    with pytest.raises(ValueError, match="pairs"):
        lr_multipliers(c)
    assert lr_multipliers(base_config().train.optim) == ()


def test_bad_frozen_raises():
    c = base_config().train.optim
    c.frozen = ("",)
    with pytest.raises(ValueError, match=r"optim.frozen = \('',\): must be a tuple of names \(parameter-name prefixes\)"):
        frozen_prefixes(c)
    c.frozen = ("embed_tokens", "layers.0")
    assert frozen_prefixes(c) == ("embed_tokens", "layers.0")


def test_prefix_matching_no_parameter_raises():
    """e.g. a per-layer prefix on a scan_layers model, whose layers are 'layers.<name>'."""
    c = base_config().train.optim
    c.lr_multipliers = (("layers.0", 2.0),)
    tx, _ = make_optimizer(c, 10)
    with pytest.raises(ValueError, match=r"'layers.0' matches no parameter .* scan_layers"):
        tx.init({"layers.self_attn.q_proj": jnp.ones((3, 4)), "norm.scale": jnp.ones(4)})


def test_the_schedule_counts_grpo_steps_not_optimizer_updates(tmp_path):
    """The reported case (verl #399, SkyRL #872): mu = 2 epochs x M = 2 mini-batches, 40
    steps, the default warm-up of 10 steps and cosine decay. Every one of the 160 updates
    applies the documented rate of its step, the one the loop logs (before: warm-up ended
    after 2.5 steps and the floor was reached at step 11)."""
    import math
    import types

    import jax
    import numpy as np

    from train.run import grpo_stage
    from train.run.loop import Loop

    cfg = base_config()
    cfg.train.steps, cfg.train.updates_per_batch, cfg.train.mini_batches = 40, 2, 2
    cfg.rollout.prompts_per_step = 4
    o = cfg.train.optim
    loop = Loop(cfg, types.SimpleNamespace(workdir=tmp_path), grpo_stage.stage(cfg))

    def documented(step: int) -> float:  # linear warm-up from 0, then cosine to the floor
        k = step - 1
        if k < o.warmup_steps:
            return o.lr * k / o.warmup_steps
        t = (k - o.warmup_steps) / (cfg.train.steps - o.warmup_steps)
        return o.lr * (o.end_lr_ratio + (1 - o.end_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))

    # a constant gradient (clipped to norm 1, still constant): Adam's bias-corrected step is
    # then the rate times 1 / (1 + eps), so the parameter's change is the rate applied
    params = {"w": jnp.zeros(3)}
    state = loop.tx.init(params)
    update = jax.jit(loop.tx.update)
    applied, logged = [], []
    for step in range(1, cfg.train.steps + 1):
        logged.append(float(loop.schedule(step - 1)))
        for _ in range(4):
            u, state = update({"w": jnp.ones(3)}, state, params)
            applied.append((step, -float(u["w"][0])))
    want = np.array([documented(s) for s, _ in applied])
    np.testing.assert_allclose([a for _, a in applied], want, rtol=1e-5, atol=1e-12)
    np.testing.assert_allclose(logged, [documented(s) for s in range(1, 41)], rtol=1e-6)
    assert documented(11) == pytest.approx(o.lr) and logged[10] == pytest.approx(o.lr)


def test_a_skipped_update_shifts_no_rate_and_the_logged_rate_is_the_applied_one(tmp_path):
    """Issue 42 item 5 (the learning-rate reports of other trainers: a schedule advanced by
    the optimizer's count drifts from the training step when an update is skipped): lr
    1e-3, warm-up 3, cosine to 0.1 over 10 steps, a NaN gradient at step 5. optax rightly
    leaves a skipped update's count where it was; on main the schedule followed that
    count while ``train.run.loop`` logged ``schedule(step - 1)``: steps 6-10 applied the
    previous step's rate (step 10: logged 1.45e-4, applied 2.69e-4) and the last step's
    rate was never applied. Now, through ``Loop.run`` with the real non-finite guard,
    every applied update of step ``s`` applies ``schedule(s - 1)`` and the logged ``lr``
    is that rate."""
    import types

    import jax
    import numpy as np

    from train.rl import nonfinite
    from train.run.loop import Loop, Stage

    cfg = base_config()
    o = cfg.train.optim
    o.lr, o.warmup_steps, o.decay, o.end_lr_ratio = 1e-3, 3, "cosine", 0.1
    cfg.checkpoint.every = 100
    written = {}
    writer = types.SimpleNamespace(enabled=False,
                                   write=lambda step, m, kind: written.setdefault(step, m))
    placement = types.SimpleNamespace(init_opt=lambda tx, p: tx.init(p))
    stream = ((i + 1, None) for i in itertools.count())
    tasks = types.SimpleNamespace(train_stream=lambda *a, start=0: stream, skipped=0)
    s = types.SimpleNamespace(workdir=tmp_path, placement=placement, tasks=tasks,
                              stage_tasks=lambda stage: tasks, exclude=set(), writer=writer)
    loop = Loop(cfg, s, Stage("grpo", 10, 1, 1, o, "train"))

    @jax.jit
    def update(params, opt_state, grads):
        return nonfinite.guarded_update(loop.tx, params, opt_state, grads, 0.0, {})

    applied = {}

    def iteration(params, opt_state, problems, key, step):
        # a constant gradient, clipped to norm 1: Adam's bias-corrected step is the rate
        # times 1 / (1 + eps), so a parameter's change is the rate applied
        g = jnp.full(3, np.nan if step == 5 else 1.0)
        new, opt_state, flags = update(params, opt_state, {"w": g})
        applied[step] = float(params["w"][0] - new["w"][0])
        return new, opt_state, lambda: {"skipped": float(flags["skipped"])}

    loop.run(lambda: {"w": jnp.zeros(3)}, iteration)
    want = [float(loop.schedule(step - 1)) for step in range(1, 11)]
    assert written[5]["skipped"] == 1 and applied[5] == 0
    got = [applied[step] for step in range(1, 11) if step != 5]
    np.testing.assert_allclose(got, [w for i, w in enumerate(want) if i != 4], rtol=1e-5,
                               atol=1e-12)
    assert want[9] == pytest.approx(1.445e-4, rel=1e-3)  # the rate of the last step
    for step in range(1, 11):  # the rate the step's updates applied (4: step 5 applied none)
        assert written[step]["lr"] == pytest.approx(want[step - 1 if step != 5 else 3],
                                                    rel=1e-6), step


def _run_updates(tx, params, grads):
    """``params`` after one ``tx`` update per gradient of ``grads`` (a leading axis)."""
    import jax
    import optax

    def body(carry, g):
        p, state = carry
        u, state = tx.update(g, state, p)
        return (optax.apply_updates(p, u), state), None

    (params, state), _ = jax.jit(lambda p, gs: jax.lax.scan(body, (p, tx.init(p)), gs))(
        params, grads)
    return params, state


def test_16_bit_parameters_train_on_float32_masters():
    """Issue 42 item 6: ``make_optimizer`` on bfloat16 parameters kept bfloat16 moments and
    applied bfloat16 updates: at lr 1e-5 a constant gradient left a weight of 1.0 at 1.0
    after 1,000 updates (an update below half a bfloat16 spacing, 2^-8 at 1.0, rounds
    away). Now AdamW runs
    on float32 masters: the bfloat16 weights are exactly the float32 run's rounded to
    bfloat16 (random weights and gradients, per-prefix multiplier, a frozen bfloat16
    parameter untouched and without a master), and the moments are float32."""
    import jax
    import numpy as np

    c = base_config().train.optim
    c.lr, c.warmup_steps, c.decay, c.weight_decay = 1e-5, 0, "constant", 0.01
    c.frozen, c.lr_multipliers = ("embed",), (("norm", 30.0),)
    tx, _ = make_optimizer(c, 1000)
    # the reported case: one weight of 1.0 and a constant gradient
    one = {"w": jnp.ones(1, jnp.bfloat16), "norm.scale": jnp.ones(1, jnp.bfloat16),
           "embed": jnp.ones(1, jnp.bfloat16)}
    grads = {k: jnp.full((1000, 1), 0.5, jnp.bfloat16) for k in one}
    after, _ = _run_updates(tx, one, grads)
    assert float(after["w"][0]) < 0.995 and float(after["embed"][0]) == 1.0
    # random weights and gradients against the float32 run
    from train.rl.optim import MastersState

    rng = np.random.default_rng(0)
    shapes = {"w": (16, 8), "norm.scale": (8,), "embed": (4, 8)}
    p16 = {k: jnp.asarray(rng.normal(size=s), jnp.bfloat16) for k, s in shapes.items()}
    g16 = {k: jnp.asarray(rng.normal(size=(300, *s)), jnp.bfloat16) for k, s in shapes.items()}
    got, state = _run_updates(tx, p16, g16)
    want, _ = _run_updates(tx, jax.tree.map(lambda x: x.astype(jnp.float32), p16),
                           jax.tree.map(lambda x: x.astype(jnp.float32), g16))
    masters = next(x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, MastersState)) if isinstance(x, MastersState))
    assert masters.master["embed"] is None  # frozen: no copy, no change
    np.testing.assert_array_equal(np.asarray(got["embed"]), np.asarray(p16["embed"]))
    for k in ("w", "norm.scale"):
        # the masters are the float32 run (to float32 rounding: XLA fuses the two
        # programs differently), the weights exactly the masters rounded to bfloat16
        np.testing.assert_allclose(masters.master[k], want[k], rtol=1e-5, atol=1e-7)
        assert got[k].dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got[k], np.float32), np.asarray(
            masters.master[k].astype(jnp.bfloat16), np.float32))
        moved = np.abs(np.asarray(want[k]) - np.asarray(p16[k], np.float32))
        assert moved.max() > 1e-4, k  # 300 updates at 1e-5 moved the masters
    floats = [x for x in jax.tree.leaves(masters.inner) if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)


def test_a_checkpoint_of_another_optimizer_layout_is_named_not_resumed(tmp_path):
    """A run directory whose checkpoint holds an optimizer state of another layout (one
    written before the rate and the float32 masters joined the state, here plain AdamW's):
    the resume stops before any step, naming the directory, the step and the way out; the
    checkpoint is left as it was."""
    import types

    import jax
    import optax

    from train.run.checkpoint import Checkpointer
    from train.run.loop import Loop, Stage

    cfg = base_config()
    params = {"w": jnp.ones(3)}
    ckpt = Checkpointer(tmp_path / "grpo", 1, 2)
    ckpt.save(2, {"params": params, "opt_state": optax.adamw(1e-3).init(params),
                  "rng": {"key": jax.random.key_data(jax.random.key(0))}},
              {"step": 2, "data_position": 2}, force=True)
    ckpt.close()

    def abstract_state(tx):
        return {"params": jax.eval_shape(lambda: params),
                "opt_state": jax.eval_shape(tx.init, params)}

    s = types.SimpleNamespace(workdir=tmp_path, exclude=set(),
                              placement=types.SimpleNamespace(abstract_state=abstract_state),
                              writer=types.SimpleNamespace(enabled=False))
    loop = Loop(cfg, s, Stage("grpo", 10, 1, 1, cfg.train.optim, "train"))
    with pytest.raises(ValueError, match=r"grpo: the optimizer state of checkpoint step 2 has "
                                         r"another layout .* init.sft_checkpoint="):
        loop.run(lambda: params, None)
    assert Checkpointer(tmp_path / "grpo", 1, 2).all_steps() == [2]
