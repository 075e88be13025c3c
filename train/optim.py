"""Optimiser: optax AdamW with linear warmup, cosine / linear / constant decay and
global-norm gradient clipping."""

from __future__ import annotations

import optax

from train import domains as d

DECAYS = ("cosine", "linear", "constant")
#: The domains of an ``optim`` section's keys these functions read (``train/config.py``
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
    """The rate of optimizer update ``u`` (optax's count, from 0) when each training step
    makes ``updates_per_step`` updates: ``steps_schedule(u // updates_per_step)``, so every
    update of step ``s`` (from 1) applies ``steps_schedule(s - 1)``, the rate the loop logs.

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
    ``tx.init`` raises ``ValueError`` for a ``frozen`` / ``lr_multipliers`` prefix that
    matches no parameter (``check_prefixes``).

    The schedule counts training steps (``warmup_steps`` too), whatever the number of
    optimizer updates each makes (a GRPO step makes ``updates_per_batch x mini_batches``):
    optax advances a schedule once per update, so ``rate`` is ``per_update(schedule,
    updates_per_step)``, constant over a step's updates. This is how PPO-style trainers
    anneal the rate once per rollout (CleanRL; verl since its issue #399), and it keeps
    ``warmup_steps`` and the decay's length in the unit the config gives them.

    Args:
      cfg: the ``optim`` config section (lr, warmup_steps, decay, end_lr_ratio, b1, b2,
        eps, weight_decay, clip_norm, frozen).
      total_steps: length of the schedule in training steps.
      updates_per_step: optimizer updates per training step.

    Returns:
      ``tx`` and ``schedule``, the rate of each training step (``schedule(s - 1)`` for
      step ``s``: the rate every update of that step applies).
    """
    steps_lr = schedule(cfg, total_steps)
    lr = per_update(steps_lr, updates_per_step)

    def adamw(mult: float):
        rate = lr if mult == 1.0 else (lambda step: mult * lr(step))
        return optax.adamw(rate, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay)

    frozen = frozen_prefixes(cfg)
    mults = lr_multipliers(cfg)
    if not frozen and not mults:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw(1.0)), steps_lr

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
    tx = optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                     optax.multi_transform(groups, labels))
    return tx, steps_lr


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
