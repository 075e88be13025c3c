"""KV-cache decoding: greedy tokens and per-step logits equal a full forward per step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import get_config
from tests.support.models import random_model, random_tokens

STEPS = 16


@nnx.jit
def full_logits(model, tokens, positions, segment_ids):
    return model.logits(model(tokens, positions, segment_ids).hidden)


@nnx.jit
def cached_logits(model, cache, tokens, positions, segment_ids):
    out = model(tokens, positions, segment_ids, cache)
    return model.logits(out.hidden), out.cache


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_greedy_decode_with_cache_matches_full_forward(preset):
    model = random_model(get_config(preset, dtype="float32"), seed=3)
    lengths = np.array([5, 3])
    batch, prompt_len = len(lengths), int(lengths.max())
    prompts = random_tokens((batch, prompt_len), seed=20)
    rows = np.arange(batch)

    # Reference: re-run the whole sequence (prompt + generated so far, padding after)
    # at every step, one fixed shape.
    buf = np.zeros((batch, prompt_len + STEPS), np.int32)
    for r in rows:
        buf[r, :lengths[r]] = prompts[r, :lengths[r]]
    positions = jnp.broadcast_to(jnp.arange(buf.shape[1]), buf.shape)
    ref_tokens, ref_logits = [], []
    for step in range(STEPS):
        length = lengths + step
        seg = (np.arange(buf.shape[1]) < length[:, None]).astype(np.int32)
        logits = np.asarray(full_logits(model, jnp.asarray(buf), positions, jnp.asarray(seg)))
        last = logits[rows, length - 1]
        ref_logits.append(last)
        ref_tokens.append(last.argmax(-1))
        buf[rows, length] = ref_tokens[-1]

    # Cache: prefill the right-padded prompts, then one token per step.
    cache = model.init_cache(batch, prompt_len + STEPS)
    pad_mask = np.arange(prompt_len) < lengths[:, None]
    logits, cache = cached_logits(
        model, cache, jnp.asarray(prompts), jnp.broadcast_to(jnp.arange(prompt_len),
                                                             prompts.shape),
        jnp.asarray(pad_mask.astype(np.int32)))
    last = np.asarray(logits)[rows, lengths - 1]
    tokens, step_logits = [last.argmax(-1)], [last]
    for step in range(1, STEPS):
        logits, cache = cached_logits(
            model, cache, jnp.asarray(tokens[-1][:, None].astype(np.int32)),
            jnp.asarray((lengths + step - 1)[:, None]), jnp.ones((batch, 1), jnp.int32))
        step_logits.append(np.asarray(logits)[:, 0])
        tokens.append(step_logits[-1].argmax(-1))
    assert int(cache.index) == prompt_len + STEPS - 1

    np.testing.assert_array_equal(np.stack(tokens, 1), np.stack(ref_tokens, 1))
    assert len(set(np.stack(tokens, 1).ravel().tolist())) > 4  # a non-degenerate decode
    err = np.abs(np.stack(step_logits) - np.stack(ref_logits)).max()
    assert err <= 1e-4, err


def test_cache_overflow_is_an_error_eagerly_and_nan_under_jit():
    model = random_model(get_config("tiny", dtype="float32"), seed=4)
    tokens = random_tokens((1, 3), seed=21)
    positions = jnp.arange(3)[None]
    segments = jnp.ones((1, 3), jnp.int32)
    cache = model.init_cache(1, 4)
    out = model(tokens, positions, segments, cache)  # 3 of 4 slots
    assert np.isfinite(np.asarray(out.hidden)).all()
    with pytest.raises(ValueError, match="need 5 slots, the cache has 4"):
        model(tokens[:, :2], positions[:, :2] + 3, segments[:, :2], out.cache)
    with pytest.raises(ValueError, match="5 new tokens do not fit in a KV cache of 4"):
        model(random_tokens((1, 5), seed=22), jnp.arange(5)[None],
              jnp.ones((1, 5), jnp.int32), model.init_cache(1, 4))
    _, jit_cache = cached_logits(model, model.init_cache(1, 4), tokens, positions, segments)
    logits, _ = cached_logits(model, jit_cache, tokens[:, :2], positions[:, :2] + 3,
                              segments[:, :2])
    assert np.isnan(np.asarray(logits)).all()
    logits, _ = cached_logits(model, jit_cache, tokens[:, :1], positions[:, :1] + 3,
                              segments[:, :1])
    assert np.isfinite(np.asarray(logits)).all()


def test_overflowing_write_under_jit_never_lands_on_valid_slots():
    """Reported case (issue "Nothing silent", item 12): an 8-slot cache at index 6 given
    4 tokens under ``jit``; ``lax.dynamic_update_slice`` clamped the write back to slots
    4-7 and overwrote the valid slots 4-5. The write is dropped whole (and the step's
    hidden states are NaN): every slot keeps what it held, in every layer, for the
    per-layer ``write_kv`` and the shared ``write_tokens`` alike."""
    model = random_model(get_config("tiny", dtype="float32"), seed=4)
    step = jax.jit(lambda m, t, p, s, c: m(t, p, s, c))
    cache = model.init_cache(2, 8)
    out = step(model, random_tokens((2, 6), seed=23), jnp.arange(6)[None].repeat(2, 0),
               jnp.ones((2, 6), jnp.int32), cache)
    before = out.cache
    over = step(model, random_tokens((2, 4), seed=24), 6 + jnp.arange(4)[None].repeat(2, 0),
                jnp.ones((2, 4), jnp.int32), before)
    assert np.isnan(np.asarray(over.hidden)).all()
    after = over.cache
    for name in ("keys", "values"):
        for layer, (a, b) in enumerate(zip(getattr(before, name), getattr(after, name))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                          err_msg=f"{name}[{layer}]")
    for name in ("positions", "segment_ids"):
        np.testing.assert_array_equal(np.asarray(getattr(before, name)),
                                      np.asarray(getattr(after, name)), err_msg=name)
    # a write that fits still lands (slots 6-7)
    fit = step(model, random_tokens((2, 2), seed=25), 6 + jnp.arange(2)[None].repeat(2, 0),
               jnp.ones((2, 2), jnp.int32), before)
    assert np.isfinite(np.asarray(fit.hidden)).all()
    assert np.asarray(fit.cache.segment_ids).all()
    assert not np.array_equal(np.asarray(fit.cache.keys[0][:, 6:]),
                              np.asarray(before.keys[0][:, 6:]))
