"""``compute_per_token_logps`` with Tunix's signature, from the final hidden states.

The head runs on the completion positions only: the hidden states of the positions that
predict a completion token (a static slice, ``[B, C, H]``) go to ``jaxhead.token_logprobs``
with ``keep=None``, and the completion mask zeroes the result. Compacting through a traced
``keep`` with ``bucket = B * C`` instead (on the slice, or on the full ``[B, P + C, H]``
states) computes the same rows and gave the same compiled temporaries at the shape of
docs/integrations.md (1.35 GiB f32, 1.22 GiB bf16: the slice costs nothing XLA does not
already hold), so the plain slice is used; a smaller ``bucket`` (fewer kept tokens than
``B * C``) compacts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import common

import jaxhead
from jaxhead.integrations.tunix import heads


@functools.partial(
    jax.jit,
    static_argnames=("pad_id", "eos_id", "stop_gradient", "return_logits", "temperature",
                     "return_entropy", "bucket", "impl"),
)
def compute_per_token_logps(
    graphdef,
    state,
    prompt_tokens: jax.Array,
    completion_tokens: jax.Array,
    pad_id: int,
    eos_id: int,
    images: jax.Array | None = None,
    stop_gradient: bool = True,
    return_logits: bool = False,
    segment_ids: jax.Array | None = None,
    segment_positions: jax.Array | None = None,
    temperature: float = 1.0,
    *,
    completion_mask: jax.Array | None = None,
    return_entropy: bool = False,
    bucket: int | None = None,
    impl: str = "auto",
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Tunix's ``compute_per_token_logps`` through jaxhead: no ``[B, T, V]`` logits.

    Same arguments and return layout as ``tunix.rl.common.compute_per_token_logps``
    (Tunix 0.1.7, ``tunix/rl/common.py``): the model runs on prompt + completion as Tunix
    runs it (``common.process_ids`` builds the positions, the causal mask and the segment
    ids), but only its final hidden states are read: ``jaxhead.token_logprobs`` computes
    ``log p(token | prefix)`` (and the entropy) of the completion positions from them and
    the head weight, in float32, never holding ``[N, V]``.

    Without packing (``segment_ids`` None): ``prompt_tokens [B, P]`` (left-padded, P >= 1)
    and ``completion_tokens [B, C]``; the result is ``[B, C]``, position ``j`` the log-prob
    of ``completion_tokens[:, j]``. With packing (``segment_ids`` and ``segment_positions``
    ``[B, T]``, ``prompt_tokens [B, 0]``, ``completion_tokens [B, T]`` the packed rows): the
    result is ``[B, T]``, position ``i`` the log-prob of token ``i`` given the tokens
    ``< i`` of its segment, 0 at ``i = 0``, Tunix's layout.

    Where this differs from Tunix: positions outside ``completion_mask`` are exactly 0 (with
    zero gradient) instead of the log-prob of whatever token sits there (Tunix's losses
    mask them out, so losses and gradients agree); a packed token that starts its segment
    is 0 (Tunix reads the previous segment's last hidden state there); logits are
    accumulated in float32 even when the model computes in bf16 (Tunix rounds them to bf16
    first), so bf16 log-probs are closer to exact than Tunix's own.

    Args:
      graphdef, state: ``nnx.split(model)`` of a registered model class (Qwen3, Qwen2, or
        see ``register_model``).
      prompt_tokens: int ``[B, P]``; ``[B, 0]`` when packed.
      completion_tokens: int ``[B, C]``; the packed rows ``[B, T]`` when packed.
      pad_id, eos_id: static ints, as Tunix (``pad_id`` marks prompt / completion padding).
      images: optional, passed to the model as Tunix does.
      stop_gradient: static; stop the gradient of the results.
      return_logits: must be False: jaxhead never builds the logits (use
        ``return_entropy=True`` for what Tunix's losses read from them).
      segment_ids, segment_positions: int ``[B, T]``: packing (segment 0 = padding).
      temperature: static float; logits are divided by it unless it is 0.0 or 1.0 (Tunix's
        rule).
      completion_mask: keyword-only, bool / int ``[B, C]`` (``[B, T]`` packed): the
        positions computed. None: ``completion_tokens != pad_id`` without packing; every
        token with a predecessor in its (non-zero) segment with packing.
      return_entropy: keyword-only, static: also return the entropy (nats, of the tempered
        distribution, 0 outside the mask) that Tunix gets from
        ``algo_core.compute_entropy_from_logits(logits)``.
      bucket: keyword-only, static int: rows the kept tokens are compacted into (jaxhead's
        ``bucket``; must hold every kept token, else those log-probs are NaN). None: every
        completion position (``B * C``, ``B * (T - 1)`` packed), no compaction.
      impl: keyword-only, static: the jaxhead implementation (``"auto"``, ``"xla"``, ...).

    Returns:
      float32 ``per_token_logps`` ``[B, C]`` (``[B, T]`` packed), or
      ``(per_token_logps, entropy)``, both that shape, with ``return_entropy=True``.

    Raises:
      ValueError: ``return_logits=True``; no prompt column without packing (Tunix needs one
        too); a model that did not sow its hidden states.
      TypeError: a model class the adapter does not know (the message names it).
      NotImplementedError: LM-head parameters the registration does not read (LoRA on
        the head).
    """
    if return_logits:
        raise ValueError(
            "jaxhead.integrations.tunix.compute_per_token_logps never builds the [B, T, V] "
            "logits: pass return_entropy=True for (per_token_logps, entropy) instead"
        )
    model = nnx.merge(graphdef, state)
    head = heads.head_of(model)
    input_tokens, positions, attn_mask, input_seg_ids = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions
    )
    model_kwargs = {"positions": positions, "cache": None, "attention_mask": attn_mask}
    if heads.accepts_segment_ids(model):
        if segment_ids is not None:
            model_kwargs["segment_ids"] = segment_ids
        elif input_seg_ids is not None:
            model_kwargs["segment_ids"] = input_seg_ids
    if images is not None:
        model_kwargs["images"] = images
    hidden, _ = heads.final_hidden(model, input_tokens, model_kwargs)

    total = input_tokens.shape[1]
    packed = segment_ids is not None
    if packed:  # token i (i >= 1) is predicted at position i - 1 of its own segment
        keep = (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)
        if completion_mask is not None:
            keep = keep & completion_mask[:, 1:].astype(bool)
        first = 1
    else:
        if total == completion_tokens.shape[1]:
            raise ValueError(
                "compute_per_token_logps without packing needs a prompt column "
                f"(prompt_tokens has shape {tuple(prompt_tokens.shape)}): the first "
                "completion token is predicted from the last prompt position"
            )
        keep = (completion_tokens != pad_id if completion_mask is None
                else completion_mask.astype(bool))
        first = total - completion_tokens.shape[1]

    hidden, weight = head.operands(hidden[:, first - 1 : total - 1])
    out = jaxhead.token_logprobs(
        hidden, weight, input_tokens[:, first:].astype(jnp.int32),
        None if bucket is None else keep,
        temperature=1.0 if temperature in (0.0, 1.0) else temperature,
        softcap=head.softcap, with_entropy=return_entropy, bucket=bucket, impl=impl,
        weight_layout=head.weight_layout,
    )
    results = [out.logprobs] + ([out.entropy] if return_entropy else [])
    results = [jnp.where(keep, x, 0.0) for x in results]
    if packed:
        results = [jnp.pad(x, ((0, 0), (1, 0))) for x in results]
    if stop_gradient:
        results = jax.lax.stop_gradient(results)
    return tuple(results) if return_entropy else results[0]


def policy_logps(model, train_example, pad_id, eos_id, *, temperature, with_entropy, impl):
    """``(per_token_logps, entropy or None)`` of a Tunix ``TrainExample`` under ``model``,
    with gradients; keep = its ``completion_mask``."""
    graphdef, state = nnx.split(model)
    out = compute_per_token_logps(
        graphdef,
        state,
        prompt_tokens=train_example.prompt_ids,
        completion_tokens=train_example.completion_ids,
        pad_id=pad_id,
        eos_id=eos_id,
        stop_gradient=False,
        segment_ids=getattr(train_example, "segment_ids", None),
        segment_positions=getattr(train_example, "segment_positions", None),
        temperature=temperature,
        completion_mask=train_example.completion_mask,
        return_entropy=with_entropy,
        impl=impl,
    )
    return out if with_entropy else (out, None)
