"""Optimiser: optax AdamW with linear warmup, cosine / linear / constant decay and
global-norm gradient clipping; float32 master weights and moments for 16-bit parameters.

The learning rate is a hyperparameter of the optimizer state (``scheduled_rate``, in
the manner of ``optax.inject_hyperparams``): its schedule position is the training step,
which the loop sets before each step (``at_step``), so an update skipped as non-finite
(``train.rl.nonfinite``: nothing of the optimizer state changes) does not shift the rate of
the steps after it; and the rate the metrics report is the one the last update applied
(``applied_rate``, read from the state).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from train.config import domains as d

DECAYS = ("cosine", "linear", "constant")
#: The domains of an ``optim`` section's keys these functions read (``train/run/schema.py``
#: declares the keys with them).
DECAY = d.one_of(*DECAYS)
FROZEN = d.names(note=" (parameter-name prefixes)")
LR_MULTIPLIERS = d.pairs(
    lambda p: isinstance(p, str) and bool(p), d.POSITIVE.ok,
    "a tuple of (parameter-name prefix, multiplier > 0) pairs, e.g. (('norm', 50.0),)")


def schedule(cfg, total_steps: int) -> optax.Schedule:
    """Learning rate per step: linear warmup from 0 over ``cfg.warmup_steps``, then
    ``cfg.decay`` down to ``cfg.lr * cfg.end_lr_ratio`` at ``total_steps``.

    Raises:
      ValueError: unknown ``cfg.decay`` (the valid ones listed).
    """
    DECAY.require("optim.decay", cfg.decay)
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    end = cfg.lr * cfg.end_lr_ratio
    rest = max(total_steps - warmup, 1)
    if cfg.decay == "cosine":
        tail = optax.cosine_decay_schedule(cfg.lr, rest, alpha=cfg.end_lr_ratio)
    elif cfg.decay == "linear":
        tail = optax.linear_schedule(cfg.lr, end, rest)
    else:
        tail = optax.constant_schedule(cfg.lr)
    if warmup == 0:
        return tail
    return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), tail], [warmup])


def frozen_prefixes(cfg) -> tuple[str, ...]:
    """The ``frozen`` parameter-name prefixes of an ``optim`` section (a tuple of names).

    Raises:
      ValueError: not in ``FROZEN`` (an entry that is not a non-empty name).
    """
    return tuple(FROZEN.require("optim.frozen", d.plain(cfg.get("frozen", ()))))


def is_frozen(name: str, frozen: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in frozen)


def per_update(steps_schedule: optax.Schedule, updates_per_step: int) -> optax.Schedule:
    """The rate of optimizer update ``u`` (``RateState.count``, from 0) when each training
    step makes ``updates_per_step`` updates: ``steps_schedule(u // updates_per_step)``, so
    every update of step ``s`` (from 1) applies ``steps_schedule(s - 1)`` (``at_step``).

    Raises:
      ValueError: ``updates_per_step`` not in ``domains.COUNT``.
    """
    d.COUNT.require("updates_per_step", updates_per_step)
    if updates_per_step == 1:
        return steps_schedule
    return lambda count: steps_schedule(count // updates_per_step)


def make_optimizer(cfg, total_steps: int, updates_per_step: int = 1
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)``: ``clip_by_global_norm(cfg.clip_norm)`` then
    ``adamw(rate, b1, b2, eps, weight_decay)``; parameters named by ``cfg.frozen``
    get a zero update and no optimiser state (``optax.multi_transform``).

    Precision: AdamW runs in float32 whatever the parameters' dtype
    (``float32_masters``): a 16-bit (bfloat16 / float16) trainable parameter gets a
    float32 master copy in the optimizer state, its moments are float32, and its update
    sets it to the master rounded to its dtype. In bfloat16 an update below half the
    weight's spacing (2^-8 at 1.0) is lost to rounding (at lr 1e-5 a weight of 1.0 never
    moves), and optax keeps the moments in the parameters' dtype. This is the layout of mixed-precision training
    (Micikevicius et al., "Mixed Precision Training", ICLR 2018: float32 master weights,
    16-bit compute); MaxText's default keeps the parameters themselves in float32
    (``weight_dtype``), as this trainer does (``ModelConfig.param_dtype``), where the
    wrapper holds nothing. The masters cost 4 bytes per 16-bit trainable parameter.

    Rate: the schedule counts training steps (``warmup_steps`` too), whatever the number
    of optimizer updates each makes (a GRPO step makes ``updates_per_batch x
    mini_batches``). This is how PPO-style trainers anneal the rate once per rollout
    (CleanRL; verl since its issue #399), and it keeps ``warmup_steps`` and the decay's
    length in the unit the config gives them. The rate lives in the state
    (``scheduled_rate``): by itself it follows the count of updates,
    ``per_update(schedule, updates_per_step)`` as an optax schedule would; a training
    loop sets the position to its step before each one (``at_step``), so a skipped update
    (whose state change is undone, count included) shifts nothing after it.
    ``applied_rate(opt_state)`` is the rate the last update applied.

    Args:
      cfg: the ``optim`` config section (lr, warmup_steps, decay, end_lr_ratio, b1, b2,
        eps, weight_decay, clip_norm, frozen, lr_multipliers).
      total_steps: length of the schedule in training steps.
      updates_per_step: optimizer updates per training step.

    Returns:
      ``tx`` and ``schedule``, the rate of each training step (``schedule(s - 1)`` for
      step ``s``: the rate every update of that step applies).

    Raises:
      ValueError: a bad ``cfg`` key (``schedule``, ``frozen_prefixes``,
        ``lr_multipliers``); from ``tx.init``: a ``frozen`` / ``lr_multipliers`` prefix
        that matches no parameter (``check_prefixes``).
    """
    steps_lr = schedule(cfg, total_steps)
    frozen = frozen_prefixes(cfg)
    mults = lr_multipliers(cfg)

    def adamw_chain(learning_rate):
        return _adamw_chain(cfg, learning_rate, frozen, mults)

    tx = scheduled_rate(adamw_chain, steps_lr, updates_per_step)
    return float32_masters(tx, frozen), steps_lr


def _adamw_chain(cfg, lr, frozen: tuple[str, ...], mults: tuple[tuple[str, float], ...]
                 ) -> optax.GradientTransformation:
    """Clipping then AdamW at the rate ``lr`` (a scalar), per-prefix multipliers and
    frozen parameters (``make_optimizer``)."""

    def adamw(mult: float):
        return optax.adamw(lr if mult == 1.0 else mult * lr, b1=cfg.b1, b2=cfg.b2,
                           eps=cfg.eps, weight_decay=cfg.weight_decay)

    if not frozen and not mults:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw(1.0))

    def label(name: str) -> str:
        if is_frozen(name, frozen):
            return "frozen"
        for i, (prefix, _) in enumerate(mults):
            if is_frozen(name, (prefix,)):
                return f"group{i}"
        return "train"

    def labels(params: dict) -> dict[str, str]:
        check_prefixes(list(params), (*frozen, *(prefix for prefix, _ in mults)))
        return {k: label(k) for k in params}

    groups = {"train": adamw(1.0), "frozen": optax.set_to_zero()}
    groups.update({f"group{i}": adamw(m) for i, (_, m) in enumerate(mults)})
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.multi_transform(groups, labels))


#: The parameter dtypes ``float32_masters`` keeps a float32 copy of.
SIXTEEN_BIT = (jnp.bfloat16, jnp.float16)


class MastersState(NamedTuple):
    """``float32_masters``'s state: ``master``, the float32 copy of each 16-bit
    trainable parameter (None for the others: a float32 one is its own master, a frozen
    one never changes), and the inner transformation's state, built on the masters."""

    master: dict
    inner: optax.OptState


def float32_masters(inner: optax.GradientTransformation, frozen: tuple[str, ...] = ()
                    ) -> optax.GradientTransformation:
    """``inner`` run in float32 on 16-bit parameters (``make_optimizer``'s "Precision").

    ``inner`` sees the float32 masters as its parameters (so its moments are float32)
    and the gradients cast to float32; the update it makes is applied to the master, and
    the update returned (float32) takes each 16-bit parameter to its new master rounded
    to the parameter's dtype by ``optax.apply_updates``. float32 parameters, and those
    named by ``frozen`` (prefixes, ``is_frozen``), pass through unchanged and get no copy.

    Args:
      inner: the optimizer (any optax transformation).
      frozen: parameter-name prefixes that never change (no master).

    Returns:
      A transformation of parameter dicts ``{name: array}`` (``state.Params``).
    """

    def needs_master(name: str, p) -> bool:
        return jnp.asarray(p).dtype in SIXTEEN_BIT and not is_frozen(name, frozen)

    def upcast(params: dict, master: dict) -> dict:
        return {k: p if master[k] is None else master[k] for k, p in params.items()}

    def init(params):
        master = {k: p.astype(jnp.float32) if needs_master(k, p) else None
                  for k, p in params.items()}
        return MastersState(master, inner.init(upcast(params, master)))

    def update(grads, state, params=None):
        if params is None:
            raise ValueError("float32_masters needs the parameters (tx.update(grads, "
                             "state, params))")
        full = upcast(params, state.master)
        grads32 = {k: g.astype(jnp.float32) if state.master[k] is not None else g
                   for k, g in grads.items()}
        updates, inner_state = inner.update(grads32, state.inner, full)
        new = optax.apply_updates(full, updates)
        master = {k: None if m is None else new[k] for k, m in state.master.items()}
        out = {k: u if state.master[k] is None else
               new[k].astype(params[k].dtype).astype(jnp.float32)
               - params[k].astype(jnp.float32) for k, u in updates.items()}
        return out, MastersState(master, inner_state)

    return optax.GradientTransformation(init, update)


class RateState(NamedTuple):
    """``scheduled_rate``'s state.

    Attributes:
      count: int32 scalar, the updates counted so far: the schedule position is
        ``count // updates_per_step`` (``at_step`` sets it).
      learning_rate: float32 scalar, the rate the last update applied (the schedule's
        start before any).
      inner: the inner transformation's state.
    """

    count: jax.Array
    learning_rate: jax.Array
    inner: optax.OptState


def scheduled_rate(build, steps_schedule: optax.Schedule, updates_per_step: int = 1
                   ) -> optax.GradientTransformation:
    """The transformation ``build(learning_rate)`` at the rate of ``steps_schedule``, taken
    at ``count // updates_per_step`` (``RateState``): the rate of each update is recorded
    in the state, and its position can be set (``at_step``). As
    ``optax.inject_hyperparams`` with a schedule, whose position is its own count of
    updates, hidden in its state; here it is the training step.

    Args:
      build: ``learning_rate (float32 scalar) -> optax.GradientTransformation`` (its state
        must not depend on the rate's value).
      steps_schedule: the rate per training step (from 0).
      updates_per_step: optimizer updates per training step.

    Raises:
      ValueError: ``updates_per_step`` not in ``domains.COUNT``.
    """
    position = per_update(steps_schedule, updates_per_step)

    def rate(count):
        return jnp.asarray(position(count), jnp.float32)

    def init(params):
        count = jnp.zeros((), jnp.int32)
        return RateState(count, rate(count), build(rate(count)).init(params))

    def update(grads, state, params=None):
        lr = rate(state.count)
        updates, inner = build(lr).update(grads, state.inner, params)
        return updates, RateState(state.count + 1, lr, inner)

    return optax.GradientTransformation(init, update)


def _rate_states(opt_state) -> list[RateState]:
    """The ``RateState`` s in ``opt_state``."""
    return [x for x in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, RateState))
            if isinstance(x, RateState)]


def at_step(opt_state, step: int, updates_per_step: int = 1):
    """``opt_state`` (of ``make_optimizer``'s ``tx``) with its rate's schedule position at
    training step ``step`` (from 1): every update of that step applies ``schedule(step -
    1)`` whatever was skipped before. The position is the rate's own count
    (``RateState.count = (step - 1) * updates_per_step``), not AdamW's (its bias
    correction counts the updates applied).

    Raises:
      ValueError: ``opt_state`` has no ``RateState`` (not ``make_optimizer``'s), or
        ``step`` < 1.
    """
    d.COUNT.require("step", step)
    if not _rate_states(opt_state):
        raise ValueError("at_step: this optimizer state has no scheduled rate "
                         "(train.rl.optim.scheduled_rate; make_optimizer's has one)")

    def position(x):
        if not isinstance(x, RateState):
            return x
        count = np.int32((step - 1) * updates_per_step)
        sharding = getattr(x.count, "sharding", None)
        if sharding is None or jax.process_count() == 1:
            return x._replace(count=jax.device_put(count, sharding))
        return x._replace(count=jax.make_array_from_callback((), sharding, lambda _: count))

    return jax.tree.map(position, opt_state, is_leaf=lambda x: isinstance(x, RateState))


def applied_rate(opt_state) -> float:
    """The learning rate the last update of ``opt_state`` applied (before any
    ``lr_multipliers``; the schedule's start before any update), read from its
    ``RateState``.

    Raises:
      ValueError: ``opt_state`` has no ``RateState``.
    """
    states = _rate_states(opt_state)
    if not states:
        raise ValueError("applied_rate: this optimizer state has no scheduled rate "
                         "(train.rl.optim.scheduled_rate)")
    return float(states[0].learning_rate)


def check_prefixes(names: list[str], prefixes: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the first of ``prefixes`` that matches none of the
    parameter ``names`` (a typo, or a per-layer ``"layers.N"`` prefix on a
    ``ModelConfig.scan_layers`` model, whose layers are stacked as ``layers.<name>``)."""
    for prefix in prefixes:
        if not any(is_frozen(name, (prefix,)) for name in names):
            raise ValueError(
                f"optim prefix {prefix!r} matches no parameter (e.g. {names[:3]}); a model "
                f"with scan_layers stacks its layers as 'layers.<name>' [L, ...], so "
                f"per-layer prefixes such as 'layers.0' need scan_layers=False"
            )


def lr_multipliers(cfg) -> tuple[tuple[str, float], ...]:
    """``(prefix, multiplier)`` pairs of an ``optim`` section's ``lr_multipliers``
    (e.g. ``(("norm", 30.0), ("layers.0", 2.0))``).

    Raises:
      ValueError: not in ``LR_MULTIPLIERS``.
    """
    pairs = LR_MULTIPLIERS.require("optim.lr_multipliers", cfg.get("lr_multipliers", ()))
    return tuple((prefix, float(m)) for prefix, m in pairs)
