"""Rollouts: jitted KV-cache decoding that samples from the head with jaxhead's chunked
Gumbel-max (or nucleus sampling) and records each sampled token's log-prob.

A ``Generator`` is built once per run (by ``train.grpo``) and owns its compiled decoders;
``temperature`` is traced, so greedy and sampled calls share one.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxhead import sampling
from train.placement import to_host
from train.state import ModelDef, Params

#: The ``sampling_path`` metric: which sampler drew a rollout's tokens.
PATH_GUMBEL = "chunked_gumbel_max"  # jaxhead's chunked Gumbel-max: no [B, V] logits
PATH_TOP_P = "full_logits_top_p"  # nucleus sampling from full float32 logits


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


def _pick(model, hidden, key, temperature, *, num_valid: int, top_p: float | None):
    """One token per row of ``hidden`` ``[B, H]`` and its log-prob: the one call of
    jaxhead's sampler (``top_p`` None: the chunked Gumbel-max; else nucleus)."""
    dtype = model.lm_head.dtype or hidden.dtype
    sampler, extra = ((sampling.sample, {}) if top_p is None
                      else (sampling.top_p_sample, {"top_p": top_p}))
    return sampler(hidden.astype(dtype), model.lm_head.weight(dtype), key,
                   temperature=temperature, softcap=model.lm_head.softcap,
                   num_valid=num_valid, **extra)


def _decoder(mdef: ModelDef, max_new_tokens: int, top_p: float | None,
             stop_ids: tuple[int, ...], num_valid: int):
    """The jitted decoder ``(params, prompts, lens, key, temperature) -> (tokens, logprobs,
    lengths, stopped)``; ``temperature`` is a traced argument."""

    def pick(model, hidden, key, temperature):
        return _pick(model, hidden, key, temperature, num_valid=num_valid, top_p=top_p)

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


class Generator:
    """Samples completions with the KV cache; built once per run, it owns its compiled
    decoders (one for the Gumbel-max path, one for nucleus sampling if used).

    Args:
      mdef: the policy's model definition.
      max_new_tokens: completion budget T.
      stop_ids: generation of a row ends after any of these.
      num_valid: only ids below it are sampled.
      top_p: ``< 1`` uses the full-logits nucleus path whenever ``temperature > 0``.
    """

    def __init__(self, mdef: ModelDef, *, max_new_tokens: int, stop_ids: tuple[int, ...],
                 num_valid: int, top_p: float = 1.0):
        self.mdef, self.max_new_tokens, self.top_p = mdef, max_new_tokens, float(top_p)
        self.stop_ids, self.num_valid = tuple(stop_ids), int(num_valid)
        self._decoders: dict[float | None, object] = {}

    def _decoder(self, top_p: float | None):
        if top_p not in self._decoders:
            self._decoders[top_p] = _decoder(self.mdef, self.max_new_tokens, top_p,
                                             self.stop_ids, self.num_valid)
        return self._decoders[top_p]

    def __call__(self, params: Params, prompts, key: jax.Array, *, temperature: float
                 ) -> Rollout:
        """Sample one completion per prompt.

        Args:
          params: the policy's parameters.
          prompts: token id sequences (``B`` of them, any lengths >= 1).
          key: PRNG key (step ``t`` draws with ``fold_in(key, t)``).
          temperature: ``> 0`` samples, 0 is greedy.

        Returns:
          ``Rollout`` (host arrays; on several processes every process reads every row).

        Raises:
          ValueError: ``temperature < 0``.
        """
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        padded, lens = pad_prompts(list(prompts))
        nucleus = self.top_p < 1.0 and temperature > 0
        fn = self._decoder(self.top_p if nucleus else None)
        toks, lps, length, done = to_host(  # every process reads every row
            fn(params, padded, lens, key, jnp.float32(temperature)))
        return Rollout(toks, lps, length, done, PATH_TOP_P if nucleus else PATH_GUMBEL)
