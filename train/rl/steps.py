"""Jitted steps: supervised (CE) update, GRPO update, reference log-probs.

Every log-prob comes from ``Transformer.token_logprobs`` (jaxhead; per token shard under a
multi-device mesh) on the kept tokens (``train.rl.packing.keep``), compacted into the static
``bucket`` the host picked (``Placement.bucket``). With ``skip=False`` the head runs on
every position (``keep=None``, ``bucket=None``; labels without a next token are replaced by
0 and masked out of the loss): the A/B switch, same loss and gradients, more FLOPs. A batch
that carries ``min_logit`` (truncated rollouts scored on the sampler's support,
``loss.logprob_support``) restricts each completion token's softmax, the policy's and the
reference's, to ``{v : tempered logit >= min_logit}``: for the policy that is the support
the token was drawn from; the reference is scored at the same threshold on its own logits
(the same support while it is near the policy, exact at the first step).

The factories below build (trace lazily, compile on first call) one jitted function each;
a trainer calls each factory once per run and keeps the result (nothing is cached here,
so a function and its compiled variants live as long as the run that owns them). The
batch ``b`` is ``train.rl.placement.place_batch(packed.arrays(...), mesh)``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from train.rl import nonfinite, packing, rl_loss
from train.rl.optim import is_frozen
from train.rl.placement import Placement
from train.rl.state import ModelDef, Params


def _stop_frozen(params: Params, frozen: tuple[str, ...]) -> Params:
    """``params`` with ``lax.stop_gradient`` on the frozen ones (``optim.frozen``): no
    gradient is formed for them (e.g. no dense ``[V, H]`` embedding gradient)."""
    if not frozen:
        return params
    return {k: jax.lax.stop_gradient(v) if is_frozen(k, frozen) else v
            for k, v in params.items()}


def _head_args(b, *, skip: bool, bucket: int | None) -> dict:
    """``labels``, ``keep`` and ``bucket`` of ``Transformer.token_logprobs`` for a batch:
    the kept tokens only (``skip``), or every position (``bucket`` unused)."""
    if skip:
        keep = packing.keep(b["loss_mask"], b["segment_ids"])
        return {"labels": b["labels"], "keep": keep, "bucket": bucket}
    return {"labels": jnp.where(b["labels"] >= 0, b["labels"], 0), "keep": None,
            "bucket": None}


def _policy(mdef: ModelDef, params: Params, b, *, skip: bool, bucket: int, temperature: float,
            with_entropy: bool, frozen: tuple[str, ...] = (), replay: bool = False):
    """``(HeadOutput, DecoderOutput)`` of ``params`` on the batch
    (``Transformer.token_logprobs``); ``replay``: the MoE layers use the batch's
    ``routes`` (routing replay).

    Raises:
      ValueError: ``replay`` and a batch without ``routes`` (a rollout that recorded
        none).
    """
    model = mdef.merge(_stop_frozen(params, frozen))
    min_logit = None  # the rollouts' truncated support, when the batch carries it
    if "min_logit" in b:
        min_logit = jnp.where(b["loss_mask"] > 0, b["min_logit"], -jnp.inf)
    if replay and "routes" not in b:
        raise ValueError("routing replay needs the batch's routes: the rollout recorded "
                         "none (train.rl.rollout.Generator(record_routes=True))")
    return model.token_logprobs(b["tokens"], b["positions"], b["segment_ids"],
                                **_head_args(b, skip=skip, bucket=bucket),
                                temperature=temperature, with_entropy=with_entropy,
                                min_logit=min_logit, routes=b["routes"] if replay else None)


def _aux_weight(mdef: ModelDef) -> float:
    return mdef.cfg.router_aux_loss_coef if mdef.cfg.is_moe else 0.0


def _moe_metrics(mdef: ModelDef, out, share=1.0) -> dict:
    """``moe_dropped_fraction`` (the real (token, expert) pairs the MoE dropped for
    capacity, ``DecoderOutput.dropped_fraction``) for an MoE model, nothing for a dense
    one; for a micro-batch, weighted by its ``share`` of the mini-batch's real tokens
    (``_combine`` sums the shares)."""
    if not mdef.cfg.is_moe:
        return {}
    return {"moe_dropped_fraction": out.dropped_fraction * share}


def _route_counts(out, b) -> dict:
    """The routes the forward took against the sampler's, as counts the micro-batches
    add up (``expert_disagreement`` divides them in ``grpo_step``): ``routes_recorded``,
    the (token, MoE layer, slot) routes the batch's ``routes`` hold (-1: none), and
    ``routes_differ``, those whose expert is not among the experts the forward's layer
    used for that token (a set comparison: the order of a token's k experts is not a
    disagreement). Nothing without recorded routes."""
    if "routes" not in b or out.routes is None:
        return {}
    recorded, used = b["routes"], out.routes
    known = recorded >= 0
    found = jnp.any(recorded[..., :, None] == used[..., None, :], axis=-1)
    return {"routes_recorded": jnp.sum(known, dtype=jnp.float32),
            "routes_differ": jnp.sum(known & ~found, dtype=jnp.float32)}


def _disagreement(metrics: dict) -> dict:
    """``metrics`` with ``_route_counts``' counts replaced by ``expert_disagreement``:
    the fraction of the sampler's recorded routes that the trainer's forward did not take
    (0 when the forward replays them)."""
    if "routes_recorded" not in metrics:
        return metrics
    metrics = dict(metrics)
    total, differ = metrics.pop("routes_recorded"), metrics.pop("routes_differ")
    return {**metrics, "expert_disagreement": differ / jnp.maximum(total, 1.0)}


def _real_share(b, norm) -> jax.Array | float:
    """The batch's share of its mini-batch's real (non-padding) tokens: the weight of its
    load-balancing loss and MoE metrics (1 for a whole batch). A padding-only micro-batch
    weighs 0: its router counted nothing."""
    if norm is None or norm.real is None:
        return 1.0
    return jnp.sum(b["segment_ids"] > 0, dtype=jnp.float32) / jnp.maximum(norm.real, 1.0)


def _apply(tx, params, opt_state, grads, loss, metrics: dict):
    """``(params, opt_state, metrics)`` after ``tx``'s update, skipped when anything is
    non-finite (``train.rl.nonfinite.guarded_update``: its flags join ``metrics``, with
    ``grad_norm``)."""
    params, opt_state, flags = nonfinite.guarded_update(tx, params, opt_state, grads, loss,
                                                        metrics)
    return params, opt_state, {**metrics, **flags, "grad_norm": optax.tree.norm(grads)}


def _jit(fn, placement: Placement | None, out_shardings=None, **jit_kwargs):
    """``jax.jit`` (no placement) or ``placement.jit`` with ``out_shardings()``."""
    if placement is None:
        return jax.jit(fn, **jit_kwargs)
    return placement.jit(fn, out_shardings=out_shardings and out_shardings(), **jit_kwargs)


def sft_step(mdef: ModelDef, tx: optax.GradientTransformation,
             placement: Placement | None = None, *, skip: bool = True,
             frozen: tuple[str, ...] = ()):
    """Jitted ``(params, opt_state, batch, bucket) -> (params, opt_state, metrics)``.

    Loss: ``-sum(w logp) / sum(w)`` with CE weights ``w = loss_mask`` (completion tokens),
    plus the MoE load-balancing loss weighted by ``router_aux_loss_coef``. ``bucket`` is
    static; ``params`` and ``opt_state`` are donated. Metrics: ``loss``, ``nll`` (nats per
    completion token), ``grad_norm``, and for an MoE model ``moe_dropped_fraction``
    (``_moe_metrics``). ``frozen``: parameter-name prefixes without gradient
    (``optim.frozen``). ``placement``: the run's ``train.rl.placement.Placement`` (None: one
    device).
    """

    def loss_fn(params, b, bucket):
        head, out = _policy(mdef, params, b, skip=skip, bucket=bucket, temperature=1.0,
                            with_entropy=False, frozen=frozen)
        w = b["loss_mask"]
        nll = -(head.logprobs * w).sum() / jnp.maximum(w.sum(), 1.0)
        bad = nonfinite.flag(jnp.any((w > 0) & ~jnp.isfinite(head.logprobs)))
        return nll + _aux_weight(mdef) * out.aux_loss, {
            "nll": nll, "nonfinite_logprob": bad, **_moe_metrics(mdef, out)}

    def step(params, opt_state, b, bucket):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, b, bucket)
        return _apply(tx, params, opt_state, grads, loss, {"loss": loss, **metrics})

    return _jit(step, placement, lambda: placement.update_shardings(tx),
                static_argnames="bucket", donate_argnums=(0, 1))


def reference_logprobs(mdef: ModelDef, placement: Placement | None = None, *,
                       temperature: float, skip: bool = True, routing_replay: bool = False):
    """Jitted ``(params, batch, bucket) -> float32 [R, L]`` log-probs of the kept tokens
    (0 elsewhere) under ``params`` at ``temperature``: the frozen reference model's
    forward, through jaxhead on the kept tokens only (no logits kept). ``bucket`` is
    static; ``placement``: as ``sft_step``; ``routing_replay``: the MoE layers use the
    batch's recorded ``routes`` (the old policy's forward under routing replay)."""

    def ref(params, b, bucket):
        head, _ = _policy(mdef, params, b, skip=skip, bucket=bucket, temperature=temperature,
                          with_entropy=False, replay=routing_replay)
        return head.logprobs * b["loss_mask"]

    return _jit(ref, placement, lambda: placement.batch, static_argnames="bucket")


def grpo_loss_fn(mdef: ModelDef, loss_cfg: rl_loss.LossConfig, temperature: float,
                 skip: bool, frozen: tuple[str, ...] = (), routing_replay: bool = False):
    """``(params, batch, ref_logp, num_seqs, bucket, norm=None) -> (loss,
    (metrics, logp))``, the differentiable GRPO objective on a packed batch whose values
    hold ``old_logp`` (the sampler's), ``advantages`` and optionally ``trainer_logp``
    (``train.rl.rl_loss.grpo_loss`` plus the MoE load-balancing loss); the metrics are
    ``grpo_loss``'s and ``_moe_metrics``. ``norm`` (``rl_loss.LossNorm``): the batch is a
    micro-batch of a mini-batch with these counts; its load-balancing loss (the
    Switch loss of its own tokens) enters weighted by its share of the mini-batch's real
    tokens (``_real_share``), so the parts add up to the whole batch's when they route
    alike, and padding-only parts weigh 0 (MaxText #1483: weighing each of ``m`` parts
    ``1 / m`` halved the loss with two padding-only parts of four). ``routing_replay``:
    the MoE layers use the batch's recorded ``routes``; a batch with ``routes`` also
    gives ``_route_counts``."""

    def loss_fn(params, b, ref_logp, num_seqs, bucket, norm=None):
        head, out = _policy(mdef, params, b, skip=skip, bucket=bucket,
                            temperature=temperature, with_entropy=True, frozen=frozen,
                            replay=routing_replay)
        loss, metrics = rl_loss.grpo_loss(
            loss_cfg, head.logprobs, b["old_logp"], b["advantages"], b["loss_mask"],
            b["seq_index"], num_seqs, ref_logp=ref_logp, entropy=head.entropy,
            trainer_logp=b.get("trainer_logp"), norm=norm)
        share = _real_share(b, norm)
        metrics = {**metrics, **_moe_metrics(mdef, out, share), **_route_counts(out, b)}
        return loss + _aux_weight(mdef) * share * out.aux_loss, (metrics, head.logprobs)

    return loss_fn


def _gap_metrics(logp, b, norm=None) -> dict:
    """``|logp_trainer - logp_sampler|`` on the completion tokens: mean (with ``norm``: this
    micro-batch's share of the mini-batch's mean) and max."""
    mask = b["loss_mask"]
    gap = jnp.abs(logp - b["old_logp"]) * mask
    total = mask.sum() if norm is None else norm.tokens
    return {"logprob_diff_mean": gap.sum() / jnp.maximum(total, 1.0),
            "logprob_diff_max": gap.max()}


def _combine(total: dict, part: dict) -> dict:
    """Metrics of micro-batches added up: ``*_max`` by maximum, the rest (shares of the
    mini-batch's means and losses) by sum."""
    return {k: jnp.maximum(total[k], v) if k.endswith("_max") else total[k] + v
            for k, v in part.items()}


def kept_counts_fn(mdef: ModelDef, loss_cfg: rl_loss.LossConfig, temperature: float,
                   skip: bool, routing_replay: bool = False):
    """``(params, batch, num_seqs, bucket) -> (tokens, seqs)``: ``rl_loss.kept_counts`` of
    a packed batch, the tokens ratio masking keeps and the completions holding one. The
    ratio is taken against the batch's ``trainer_logp`` where known; where not (the
    sampler's log-probs as the old policy, or NaN entries) against a forward of ``params``
    without gradient, the log-probs ``grpo_loss`` reads in the update."""

    def forward(params, b, bucket):
        head, _ = _policy(mdef, params, b, skip=skip, bucket=bucket, temperature=temperature,
                          with_entropy=False, replay=routing_replay)
        return jax.lax.stop_gradient(head.logprobs)

    def counts(params, b, num_seqs, bucket):
        mask = b["loss_mask"]
        trainer = b.get("trainer_logp")
        if trainer is None:
            logp = forward(params, b, bucket)
        else:  # a forward only if some token's old log-prob is not known yet
            missing = jnp.any((mask > 0) & jnp.isnan(trainer))
            logp = jax.lax.cond(missing, lambda: forward(params, b, bucket),
                                lambda: jnp.where(mask > 0, trainer, 0.0))
        return rl_loss.kept_counts(loss_cfg, logp, b["old_logp"], mask, b["seq_index"],
                                   num_seqs, trainer_logp=trainer)

    return counts


def _accumulate(loss_fn, params, batches, refs, norm, num_seqs, bucket, count_fn=None):
    """``(grads, metrics, logps)`` of a mini-batch given as micro-batches ``batches`` (a
    tuple of packed batches with the same shapes): their gradients summed in float32 over
    a ``lax.scan`` (one micro-batch's activations live at a time), each normalised over
    the whole mini-batch (``norm``), so the sum is the mini-batch's gradient whatever the
    split. One micro-batch (``norm`` None: its own counts) is the plain gradient.
    ``count_fn`` (``kept_counts_fn``; ratio masking): the loss's denominators depend on
    the trainer's log-probs, so with several micro-batches they are counted over all of
    them first (``rl_loss.LossNorm.with_kept``; a forward of each micro-batch whose old
    log-probs are not all known, ``lax.map``: one micro-batch's activations at a time)."""
    parts = len(batches)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def part(params, b, ref):
        (loss, (metrics, logp)), grads = grad_fn(params, b, ref, num_seqs, bucket, norm)
        return grads, {**metrics, "loss": loss, **_gap_metrics(logp, b, norm)}, logp

    if parts == 1:
        grads, metrics, logp = part(params, batches[0], None if refs is None else refs[0])
        return grads, metrics, (logp,)
    if norm is None:
        raise ValueError(f"{parts} micro-batches need the LossNorm of their mini-batch")
    xs = (jax.tree.map(lambda *x: jnp.stack(x), *batches),
          None if refs is None else jnp.stack(refs))
    if count_fn is not None:
        tokens, seqs = jax.lax.map(lambda b: count_fn(params, b, num_seqs, bucket), xs[0])
        norm = norm.with_kept(tokens.sum(), seqs.sum())

    def body(carry, x):
        grads, metrics, logp = part(params, *x)
        acc, total = carry
        acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), acc, grads)
        return (acc, _combine(total, metrics)), logp

    shapes = jax.eval_shape(part, params, *jax.tree.map(lambda x: x[0], xs))
    init = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32), shapes[:2])
    (acc, metrics), logps = jax.lax.scan(body, init, xs)
    grads = jax.tree.map(lambda a, p: a.astype(p.dtype), acc, params)
    return grads, metrics, tuple(logps[i] for i in range(parts))


def grpo_step(mdef: ModelDef, tx: optax.GradientTransformation, loss_cfg: rl_loss.LossConfig,
              placement: Placement | None = None, *, temperature: float, skip: bool = True,
              frozen: tuple[str, ...] = (), return_logp: bool = False,
              routing_replay: bool = False):
    """Jitted ``(params, opt_state, batches, ref_logps | None, num_seqs, bucket, norm=None)
    -> (params, opt_state, metrics)`` (with ``return_logp`` also ``logps``, the trainer's
    log-probs of each micro-batch before the update, as its ``loss_mask``); ``num_seqs``
    and ``bucket`` are static, ``params`` and ``opt_state`` donated. One optimizer step on
    one mini-batch.

    ``batches`` is the mini-batch as a tuple of micro-batches of one shape (one: the
    mini-batch whole), ``ref_logps`` the reference's log-probs of each (or None without
    the KL penalty), ``norm`` the ``rl_loss.LossNorm`` of the mini-batch (None: one
    micro-batch, its own counts): the gradient and the metrics are the mini-batch's,
    whatever the split (``_accumulate``; with ratio masking, whose denominators count the
    kept tokens, after a forward of each micro-batch whose old log-probs are not known).
    Several micro-batches without ``norm`` raise ``ValueError`` (each would be normalised
    by its own counts).

    Besides ``grpo_loss``'s metrics: ``loss``, ``grad_norm``, the sampler-vs-trainer
    log-prob gap on the completion tokens before the update (``logprob_diff_mean``,
    ``logprob_diff_max``: ``|logp_trainer - logp_sampler|``), for an MoE model
    ``moe_dropped_fraction`` (``_moe_metrics``) and, when the batches carry the
    sampler's ``routes``, ``expert_disagreement`` (``_disagreement``: the fraction of the
    sampler's (token, MoE layer, slot) routes the forward did not take).

    ``routing_replay``: Rollout Routing Replay (R3; Ma et al. 2025, arXiv:2510.11370):
    every forward of the policy (the update's, and the ratio-masking count's) routes each
    token to the experts the sampler recorded (the batch's ``routes``), its gate values
    from the trainer's router (``models.moe.layer.replay_route``), so
    ``expert_disagreement`` is 0 and the router still trains.

    ``placement``: a multi-device ``train.rl.placement.Placement`` compiles the step with
    its out-shardings under its mesh; None or one device: plain ``jax.jit``.
    """
    loss_fn = grpo_loss_fn(mdef, loss_cfg, temperature, skip, frozen, routing_replay)
    count_fn = (kept_counts_fn(mdef, loss_cfg, temperature, skip, routing_replay)
                if loss_cfg.masks_ratios else None)

    def step(params, opt_state, batches, ref_logps, num_seqs, bucket, norm=None):
        grads, metrics, logps = _accumulate(loss_fn, params, batches, ref_logps, norm,
                                            num_seqs, bucket, count_fn)
        metrics = _disagreement(metrics)
        params, opt_state, metrics = _apply(tx, params, opt_state, grads, metrics["loss"],
                                            metrics)
        return (params, opt_state, metrics) + ((logps,) if return_logp else ())

    def out_shardings():
        return placement.update_shardings(tx) + ((placement.batch,) if return_logp else ())

    return _jit(step, placement, out_shardings, static_argnames=("num_seqs", "bucket"),
                donate_argnums=(0, 1))
