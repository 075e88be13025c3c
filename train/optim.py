"""Optimiser: optax AdamW with linear warmup, cosine / linear / constant decay and
global-norm gradient clipping."""

from __future__ import annotations

import optax

DECAYS = ("cosine", "linear", "constant")


def schedule(cfg, total_steps: int) -> optax.Schedule:
    """Learning rate per step: linear warmup from 0 over ``cfg.warmup_steps``, then
    ``cfg.decay`` down to ``cfg.lr * cfg.end_lr_ratio`` at ``total_steps``.

    Raises:
      ValueError: unknown ``cfg.decay`` (the valid ones listed).
    """
    if cfg.decay not in DECAYS:
        raise ValueError(f"optim.decay must be one of {DECAYS}, got {cfg.decay!r}")
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
    """The ``frozen`` parameter-name prefixes of an ``optim`` section."""
    return tuple(p.strip() for p in cfg.get("frozen", "").split(",") if p.strip())


def is_frozen(name: str, frozen: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in frozen)


def make_optimizer(cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """``(tx, schedule)``: ``clip_by_global_norm(cfg.clip_norm)`` then
    ``adamw(schedule, b1, b2, eps, weight_decay)``; parameters named by ``cfg.frozen``
    get a zero update and no optimiser state (``optax.multi_transform``).

    Args:
      cfg: the ``optim`` config section (lr, warmup_steps, decay, end_lr_ratio, b1, b2,
        eps, weight_decay, clip_norm, frozen).
      total_steps: length of the schedule.
    """
    lr = schedule(cfg, total_steps)
    tx = optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(lr, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )
    frozen = frozen_prefixes(cfg)
    if frozen:
        tx = optax.multi_transform(
            {"train": tx, "frozen": optax.set_to_zero()},
            lambda params: {k: "frozen" if is_frozen(k, frozen) else "train" for k in params})
    return tx, lr
