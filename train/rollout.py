"""Rollouts: jitted KV-cache decoding that samples from the head with jaxhead's chunked
Gumbel-max (or nucleus sampling) and records each sampled token's log-prob."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jaxhead
from train import distributed
from train.state import ModelDef, Params

#: Names of the two sampling paths, as reported in training metrics.
PATH_GUMBEL = "chunked_gumbel_max"
PATH_TOP_P = "full_logits_top_p"


class Rollout(NamedTuple):
    """Host arrays of one generation call.

    Attributes:
      tokens: int32 ``[B, T]`` sampled ids (0 after the stop token).
      logprobs: float32 ``[B, T]`` sampler log-probs at the sampling temperature (0 after
        the stop token).
      lengths: int32 ``[B]`` completion lengths, the stop token included.
      stopped: bool ``[B]``: the completion ended with a stop token (else it hit
        ``max_new_tokens``).
      path: the sampling path (``PATH_GUMBEL`` or ``PATH_TOP_P``).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    path: str

    def completion(self, i: int) -> list[int]:
        """Tokens of completion ``i`` (stop token included)."""
        return self.tokens[i, : self.lengths[i]].tolist()


def pad_prompts(prompts: list[list[int]] | list[tuple[int, ...]], multiple: int = 64
                ) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``[B, P]`` int32 prompts (P rounded up to ``multiple`` so that few
    shapes compile) and their lengths ``[B]``."""
    lens = np.array([len(p) for p in prompts], np.int32)
    width = int(-(-lens.max() // multiple) * multiple)
    out = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        out[i, : len(p)] = p
    return out, lens


@functools.cache
def _generator(mdef: ModelDef, max_new_tokens: int, top_p: float | None,
               stop_ids: tuple[int, ...], num_valid: int):
    """The jitted decoder; ``temperature`` is a traced argument (greedy and sampled calls
    share one compiled function), ``top_p`` (None: the chunked Gumbel-max) is static."""

    def pick(model, hidden, key, temperature):
        dtype = model.lm_head.dtype or hidden.dtype
        w = model.lm_head.weight(dtype)
        kw = {"temperature": temperature, "softcap": model.lm_head.softcap,
              "num_valid": num_valid}
        return jaxhead.sample(hidden.astype(dtype), w, key, top_p=top_p or 1.0, **kw)

    @jax.jit
    def generate(params, prompts, lens, key, temperature):
        model = mdef.merge(params)
        batch, width = prompts.shape
        cache = model.init_cache(batch, width + max_new_tokens)
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), prompts.shape)
        seg = (pos < lens[:, None]).astype(jnp.int32)
        out = model(prompts, pos, seg, cache)
        last = out.hidden[jnp.arange(batch), lens - 1]
        tok, lp = pick(model, last, jax.random.fold_in(key, 0), temperature)
        stops = jnp.asarray(stop_ids, jnp.int32)
        toks = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(tok)
        lps = jnp.zeros((batch, max_new_tokens), jnp.float32).at[:, 0].set(lp)
        done = jnp.isin(tok, stops)
        carry = (jnp.int32(1), tok, out.cache, toks, lps, done, jnp.ones((batch,), jnp.int32))

        def cond(c):
            return (c[0] < max_new_tokens) & ~jnp.all(c[5])

        def body(c):
            step, tok, cache, toks, lps, done, length = c
            p = (lens + step - 1)[:, None]
            o = model(tok[:, None], p, jnp.ones_like(p), cache)
            new, lp = pick(model, o.hidden[:, 0], jax.random.fold_in(key, step), temperature)
            new = jnp.where(done, 0, new)
            lp = jnp.where(done, 0.0, lp)
            toks = toks.at[:, step].set(new)
            lps = lps.at[:, step].set(lp)
            length = length + (~done).astype(jnp.int32)
            return (step + 1, new, o.cache, toks, lps, done | jnp.isin(new, stops), length)

        _, _, _, toks, lps, done, length = jax.lax.while_loop(cond, body, carry)
        return toks, lps, length, done

    return generate


def generate(mdef: ModelDef, params: Params, prompts, key: jax.Array, *, max_new_tokens: int,
             temperature: float, stop_ids: tuple[int, ...], num_valid: int,
             top_p: float = 1.0) -> Rollout:
    """Sample one completion per prompt with the KV cache.

    Args:
      mdef, params: the policy.
      prompts: token id sequences (``B`` of them, any lengths >= 1).
      key: PRNG key (step ``t`` draws with ``fold_in(key, t)``).
      max_new_tokens: completion budget T.
      temperature: ``> 0`` samples, 0 is greedy.
      stop_ids: generation of a row ends after any of these.
      num_valid: only ids below it are sampled.
      top_p: ``< 1`` uses the full-logits nucleus path.

    Returns:
      ``Rollout`` (host arrays).
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    padded, lens = pad_prompts(list(prompts))
    nucleus = top_p < 1.0 and temperature > 0
    fn = _generator(mdef, max_new_tokens, float(top_p) if nucleus else None, tuple(stop_ids),
                    int(num_valid))
    toks, lps, length, done = distributed.to_host(  # every process reads every row
        fn(params, padded, lens, key, jnp.float32(temperature)))
    path = PATH_TOP_P if nucleus else PATH_GUMBEL
    return Rollout(toks, lps, length, done, path)
