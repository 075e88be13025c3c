"""Jitted steps: supervised (CE) update, GRPO update, reference log-probs.

Every log-prob comes from ``Transformer.token_logprobs`` (jaxhead) on the kept tokens:
``keep = keep_mask(loss_mask=...)``, compacted into the static ``bucket`` the host picked
(``PackedBatch.bucket()``). With ``skip=False`` the head runs on every position
(``keep=None``; labels without a next token are replaced by 0 and masked out of the
loss): the A/B switch, same loss and gradients, more FLOPs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

import jaxhead
from train import distributed, rl_loss
from train.optim import is_frozen
from train.packing import PackedBatch
from train.state import ModelDef, Params

#: Keys of the device batch built by ``device_batch``.
BATCH_KEYS = ("tokens", "positions", "segment_ids", "labels", "loss_mask", "seq_index")


def device_batch(batch: PackedBatch, *value_names: str) -> dict[str, jax.Array]:
    """The arrays a step reads: ``BATCH_KEYS`` plus the named ``batch.values``."""
    out = {k: jnp.asarray(getattr(batch, k)) for k in BATCH_KEYS}
    out.update({k: jnp.asarray(batch.values[k]) for k in value_names})
    return out


def _stop_frozen(params: Params, frozen: tuple[str, ...]) -> Params:
    """``params`` with ``lax.stop_gradient`` on the frozen ones (``optim.frozen``): no
    gradient is formed for them (e.g. no dense ``[V, H]`` embedding gradient)."""
    if not frozen:
        return params
    return {k: jax.lax.stop_gradient(v) if is_frozen(k, frozen) else v
            for k, v in params.items()}


def _head(mdef: ModelDef, params: Params, b, *, skip: bool, bucket: int, temperature: float,
          with_entropy: bool, frozen: tuple[str, ...] = ()):
    """``(HeadOutput, aux_loss)`` of the policy on the batch (see the module docstring)."""
    model = mdef.merge(_stop_frozen(params, frozen))
    if skip:
        keep = jaxhead.keep_mask(loss_mask=b["loss_mask"], segment_ids=b["segment_ids"],
                                 aligned_to="predictions")
        labels = b["labels"]
    else:
        keep, bucket = None, None
        labels = jnp.where(b["labels"] >= 0, b["labels"], 0)
    return distributed.token_logprobs(model, b["tokens"], b["positions"], b["segment_ids"],
                                      labels, keep, temperature=temperature,
                                      with_entropy=with_entropy, bucket=bucket)


def _aux_weight(mdef: ModelDef) -> float:
    return mdef.cfg.router_aux_loss_coef if mdef.cfg.is_moe else 0.0


def _apply(tx, params, opt_state, grads):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, optax.tree.norm(grads)


@functools.cache
def sft_step(mdef: ModelDef, tx: optax.GradientTransformation, skip: bool = True,
             frozen: tuple[str, ...] = (), placement=None):
    """Jitted ``(params, opt_state, batch, bucket) -> (params, opt_state, metrics)``.

    Loss: ``-sum(w logp) / sum(w)`` with CE weights ``w = loss_mask`` (completion tokens),
    plus the MoE load-balancing loss weighted by ``router_aux_loss_coef``. ``bucket`` is
    static. Metrics: ``loss``, ``nll`` (nats per completion token), ``grad_norm``.
    ``frozen``: parameter-name prefixes without gradient (``optim.frozen``).
    ``placement``: a ``train.distributed.Placement`` (None: one device).
    """

    def loss_fn(params, b, bucket):
        head, aux = _head(mdef, params, b, skip=skip, bucket=bucket, temperature=1.0,
                          with_entropy=False, frozen=frozen)
        w = b["loss_mask"]
        nll = -(head.logprobs * w).sum() / jnp.maximum(w.sum(), 1.0)
        return nll + _aux_weight(mdef) * aux, nll

    def step(params, opt_state, b, bucket):
        (loss, nll), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, b, bucket)
        params, opt_state, gnorm = _apply(tx, params, opt_state, grads)
        return params, opt_state, {"loss": loss, "nll": nll, "grad_norm": gnorm}

    return distributed.jit_step(step, placement, distributed.update_shardings(tx),
                                static_argnames="bucket", donate_argnums=(0, 1))


@functools.cache
def reference_logprobs(mdef: ModelDef, temperature: float, skip: bool = True,
                       placement=None):
    """Jitted ``(params, batch, bucket) -> float32 [R, L]`` log-probs of the kept tokens
    (0 elsewhere) under ``params`` at ``temperature``: the frozen reference model's
    forward, through jaxhead on the kept tokens only (no logits kept). ``placement``: as
    ``grpo_step``."""

    def ref(params, b, bucket):
        head, _ = _head(mdef, params, b, skip=skip, bucket=bucket, temperature=temperature,
                        with_entropy=False)
        return head.logprobs * b["loss_mask"]

    return distributed.jit_step(ref, placement, lambda p: p.batch, static_argnames="bucket")


def grpo_loss_fn(mdef: ModelDef, loss_cfg: rl_loss.LossConfig, temperature: float,
                 skip: bool, frozen: tuple[str, ...] = ()):
    """``(params, batch, ref_logp, num_seqs, bucket) -> (loss, (metrics, logp))``, the
    differentiable GRPO objective on a packed batch whose values hold ``old_logp`` and
    ``advantages``."""

    def loss_fn(params, b, ref_logp, num_seqs, bucket):
        head, aux = _head(mdef, params, b, skip=skip, bucket=bucket, temperature=temperature,
                          with_entropy=True, frozen=frozen)
        loss, metrics = rl_loss.grpo_loss(
            loss_cfg, head.logprobs, b["old_logp"], b["advantages"], b["loss_mask"],
            b["seq_index"], num_seqs, ref_logp=ref_logp, entropy=head.entropy)
        return loss + _aux_weight(mdef) * aux, (metrics, head.logprobs)

    return loss_fn


@functools.cache
def grpo_step(mdef: ModelDef, tx: optax.GradientTransformation, loss_cfg: rl_loss.LossConfig,
              temperature: float, skip: bool = True, frozen: tuple[str, ...] = (),
              placement=None):
    """Jitted ``(params, opt_state, batch, ref_logp | None, num_seqs, bucket) ->
    (params, opt_state, metrics)``; ``num_seqs`` and ``bucket`` are static.

    Besides ``grpo_loss``'s metrics: ``loss``, ``grad_norm`` and the sampler-vs-trainer
    log-prob gap on the completion tokens before the update (``logprob_diff_mean``,
    ``logprob_diff_max``: ``|logp_trainer - logp_sampler|``).

    ``placement``: a multi-device ``train.distributed.Placement`` compiles the step with
    its out-shardings under its mesh (batch from ``placement.device_batch``, bucket from
    ``placement.bucket``); None: one device.
    """
    loss_fn = grpo_loss_fn(mdef, loss_cfg, temperature, skip, frozen)

    def step(params, opt_state, b, ref_logp, num_seqs, bucket):
        (loss, (metrics, logp)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, b, ref_logp, num_seqs, bucket)
        params, opt_state, gnorm = _apply(tx, params, opt_state, grads)
        mask = b["loss_mask"]
        gap = jnp.abs(logp - b["old_logp"]) * mask
        metrics = {**metrics, "loss": loss, "grad_norm": gnorm,
                   "logprob_diff_mean": gap.sum() / jnp.maximum(mask.sum(), 1.0),
                   "logprob_diff_max": gap.max()}
        return params, opt_state, metrics

    return distributed.jit_step(step, placement, distributed.update_shardings(tx),
                                static_argnames=("num_seqs", "bucket"), donate_argnums=(0, 1))
