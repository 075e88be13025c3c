"""Non-finite values never reach the parameters.

A NaN or an infinity anywhere in a step (a log-prob, a ratio, the loss, a gradient, the
update) would make every parameter NaN at the next update, and every checkpoint after it.
The jitted steps (``train.rl.steps``) check before they apply an update and skip it when
anything is non-finite (the parameters and the optimizer state stay as they were); they
report which part went non-finite as ``nonfinite_<cause>`` flags. ``Guard`` reads the flags
of a step's updates on the host: it names each skipped update with its step and cause,
counts them (the ``nonfinite_updates`` metric) and stops the run with ``NonFiniteError``
after ``limit`` skipped updates in a row.

``optax.apply_if_finite`` does the skip for the gradient alone, and applies the update
anyway after its ``max_consecutive_errors``; here the limit stops the run instead.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax

from train.config import domains as d

#: What a step checks, in the order a cause is named: the head's log-probs of the loss's
#: tokens, the PPO ratio on them, the loss, the gradient, the optimizer's update.
CAUSES = ("logprob", "ratio", "loss", "gradient", "update")
_NAMES = {"logprob": "log-prob", "ratio": "ratio", "loss": "loss", "gradient": "gradient",
          "update": "update"}


class NonFiniteError(RuntimeError):
    """The run stopped: too many updates in a row were non-finite."""


def all_finite(tree) -> jax.Array:
    """bool scalar: every entry of every array of ``tree`` is finite."""
    leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)
              if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def flag(nonfinite: jax.Array) -> jax.Array:
    """float32 1.0 / 0.0 of a bool (metrics are floats; summed over micro-batches)."""
    return jnp.asarray(nonfinite).astype(jnp.float32)


def guarded_update(tx, params, opt_state, grads, loss, metrics: dict):
    """``(params, opt_state, flags)``: ``tx``'s update applied to ``params``, or nothing
    changed when the loss, a gradient or the update is non-finite, or a
    ``nonfinite_logprob`` / ``nonfinite_ratio`` flag of ``metrics`` is set.

    Returns:
      ``flags``: float32 scalars, ``nonfinite_<cause>`` for each of ``CAUSES`` and
      ``skipped`` (1.0 when the update was not applied, else 0.0).
    """
    updates, new_state = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    flags = {f"nonfinite_{c}": metrics.get(f"nonfinite_{c}", jnp.float32(0.0))
             for c in ("logprob", "ratio")}
    flags["nonfinite_loss"] = flag(~jnp.isfinite(loss))
    flags["nonfinite_gradient"] = flag(~all_finite(grads))
    flags["nonfinite_update"] = flag(~all_finite(updates))
    skip = sum(flags.values()) > 0

    def keep(new, old):
        return jnp.where(skip, old, new)

    params = jax.tree.map(keep, new_params, params)
    opt_state = jax.tree.map(keep, new_state, opt_state)
    return params, opt_state, {**flags, "skipped": flag(skip)}


def pop_flags(metrics: dict) -> dict:
    """The ``nonfinite_*`` and ``skipped`` entries of a step's ``metrics``, removed from it."""
    return {k: metrics.pop(k) for k in list(metrics)
            if k.startswith("nonfinite_") or k == "skipped"}


class Guard:
    """Reads the flags of each update on the host (module docstring).

    Args:
      limit: skipped updates in a row after which the run stops.
      stage: the stage's name, for the messages.
      verbose: print a line for each skipped update (on stderr).
    """

    def __init__(self, limit: int, stage: str, verbose: bool = True):
        d.COUNT.require("max_nonfinite_updates", limit)
        self.limit, self.stage, self.verbose = limit, stage, verbose
        self.in_a_row = 0

    def observe(self, step: int, updates: list[tuple[str, dict]]) -> int:
        """Take the step's updates ``(label, metrics)`` in order (host values; their
        ``nonfinite_*`` and ``skipped`` entries are removed from ``metrics``) and return
        how many were skipped.

        Raises:
          NonFiniteError: ``limit`` skipped updates in a row, naming the step, the update
            and what went non-finite.
        """
        skipped = 0
        for label, m in updates:
            flags = {c: float(m.pop(f"nonfinite_{c}", 0.0)) > 0 for c in CAUSES}
            if not float(m.pop("skipped", 0.0)):
                self.in_a_row = 0
                continue
            skipped += 1
            self.in_a_row += 1
            causes = ", ".join(_NAMES[c] for c in CAUSES if flags[c]) or "unknown"
            where = f"{self.stage} step {step}" + (f", update {label}" if label else "")
            if self.in_a_row >= self.limit:
                raise NonFiniteError(
                    f"{where}: non-finite {causes}; {self.in_a_row} updates in a row were "
                    f"non-finite (limit {self.limit}): stopping. The parameters and the "
                    f"checkpoints hold the last finite update.")
            if self.verbose:
                print(f"warning: {where}: non-finite {causes}: update skipped "
                      f"({self.in_a_row} in a row, the run stops at {self.limit})",
                      file=sys.stderr, flush=True)
        return skipped
