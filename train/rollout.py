"""Rollouts: jitted KV-cache decoding that samples from the head with jaxhead's chunked
Gumbel-max (or top-k / top-p / min-p truncated sampling) and records each sampled token's
log-prob and the support it was drawn from.

A ``Generator`` is built once per run (by ``train.grpo``) and owns its compiled decoders;
``temperature`` is traced, so greedy and sampled calls share one.

Under a multi-device ``train.placement.Placement`` a call is one SPMD program over the
run's mesh: the B rows (padded with copies of row 0 to a multiple of the batch shards,
done from the start and dropped after) are split over ``models.mesh.BATCH_AXES``, the parameters keep
their training shardings (the decoder's ``in_shardings``; the MoE runs expert-parallel,
no device gathers another's experts), the KV cache and the sampled arrays are split along
the batch, and every process reads back every row (``to_host``: a ``process_allgather``
of the small ``[B, T]`` results), so every process packs the same global batch. A row's
sampling noise depends only on the key, the decode step and the row's global index
(``jaxhead.sample`` draws its row seeds with ``jax.random.bits``, whose partitionable
Threefry counters are the element indices), so completions do not depend on the device
or process count, nor on the padding.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jaxhead
from models.mesh import BATCH_AXES, active_mesh, present
from train import domains as d
from train.placement import Placement, place_batch, to_host
from train.state import ModelDef, Params

#: The ``sampling_path`` metric: which sampler drew a rollout's tokens.
PATH_GUMBEL = "chunked_gumbel_max"  # jaxhead's chunked Gumbel-max: no [B, V] logits
PATH_TRUNCATED = "full_logits_truncated"  # top-k / top-p / min-p from full float32 logits


#: ``loss.logprob_support``'s domain: the trainer scores a truncated rollout's tokens on
#: the support they were drawn from (``Rollout.min_logit``) or on the whole softmax
#: (``Rollout.logmass`` moves the sampler's log-probs to it).
LOGPROB_SUPPORT = d.one_of("sampler", "full")


#: The domains of ``Truncation``'s fields (``rollout.top_k``, ``rollout.top_p``,
#: ``rollout.min_p``).
TOP_K = d.integer(0, note=" (0: off)")
TOP_P = d.number(0, 1, lo_open=True)
MIN_P = d.FRACTION_BELOW_1


class Truncation(NamedTuple):
    """Truncated sampling settings (``jaxhead.sample``): ``top_k`` (0: off), ``top_p``
    (1: off), ``min_p`` (0: off); any combination, the support is their intersection."""

    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def check(self) -> Truncation:
        """``self`` if each field is in its domain (``TOP_K``, ``TOP_P``, ``MIN_P``).

        Raises:
          ValueError: the first field that is not, as the config check words it.
        """
        for name, domain in zip(self._fields, (TOP_K, TOP_P, MIN_P), strict=True):
            domain.require(f"rollout.{name}", getattr(self, name))
        return self

    @property
    def active(self) -> bool:
        return bool(self.top_k) or self.top_p < 1.0 or self.min_p > 0.0


class Rollout(NamedTuple):
    """Host arrays of one generation call.

    Attributes:
      tokens: int32 ``[B, T]`` sampled ids (0 after the stop token).
      logprobs: float32 ``[B, T]`` sampler log-probs at the sampling temperature, on the
        support each token was drawn from (0 after the stop token).
      min_logit: float32 ``[B, T]`` that support's threshold on the tempered logits
        (``jaxhead.Sample.min_logit``; ``-inf``: untruncated or after the stop token).
      logmass: float32 ``[B, T]`` log of the full softmax's mass on that support (``<= 0``;
        0 when untruncated): ``logprobs + logmass`` is the full-softmax log-prob.
      lengths: int32 ``[B]`` completion lengths, the stop token included.
      stopped: bool ``[B]``: the completion ended with a stop token (else it hit
        ``max_new_tokens``).
      path: the sampling path (``PATH_GUMBEL`` or ``PATH_TRUNCATED``).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    min_logit: np.ndarray
    logmass: np.ndarray
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


def _along_batch(tree):
    """``tree`` with every array of rank >= 1 constrained to be split along its leading
    (batch) axis over the active mesh's batch axes; unchanged without a mesh."""
    mesh = active_mesh()
    if mesh is None:
        return tree
    spec = P(present(mesh, BATCH_AXES))
    return jax.tree.map(
        lambda x: jax.lax.with_sharding_constraint(x, spec) if x.ndim else x, tree)


def _decoder(mdef: ModelDef, max_new_tokens: int, truncated: bool,
             stop_ids: tuple[int, ...], num_valid: int, placement: Placement | None = None):
    """The jitted decoder ``(params, prompts, lens, num_rows, key, temperature, truncation)
    -> (tokens, logprobs, min_logit, logmass, lengths, stopped)``; rows from ``num_rows``
    on are padding (done from the start: they never keep the loop going). ``num_rows``,
    ``temperature`` and the truncation settings are traced (one compile serves every
    value), ``truncated`` picks the sampler path (False: chunked Gumbel-max, no ``[B, V]``
    logits). With a multi-device ``placement``: compiled under its mesh with the
    parameters in their training shardings and the rows, KV cache and outputs split over
    the batch axes (the row count must then be a multiple of ``placement.batch_shards``)."""

    def pick(model, hidden, key, temperature, trunc):
        dtype = model.lm_head.dtype or hidden.dtype
        kw = dict(zip(Truncation._fields, trunc)) if truncated else {}
        return jaxhead.sample(hidden.astype(dtype), model.lm_head.weight(dtype), key,
                              temperature=temperature, softcap=model.lm_head.softcap,
                              num_valid=num_valid, weight_layout=model.lm_head.weight_layout,
                              **kw)

    def generate(params, prompts, lens, num_rows, key, temperature, trunc):
        model = mdef.merge(params)
        batch, width = prompts.shape
        cache = _along_batch(model.init_cache(batch, width + max_new_tokens))
        pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), prompts.shape)
        seg = (pos < lens[:, None]).astype(jnp.int32)
        out = model(prompts, pos, seg, cache)
        last = out.hidden[jnp.arange(batch), lens - 1]
        first = pick(model, last, jax.random.fold_in(key, 0), temperature, trunc)
        stops = jnp.asarray(stop_ids, jnp.int32)
        fill = (0, 0.0, -jnp.inf, 0.0)  # each field's value after the stop token
        record = tuple(jnp.full((batch, max_new_tokens), f, x.dtype).at[:, 0].set(x)
                       for f, x in zip(fill, first))
        done = jnp.isin(first.tokens, stops) | (jnp.arange(batch) >= num_rows)
        carry = (jnp.int32(1), first.tokens, _along_batch(out.cache), _along_batch(record),
                 done, jnp.ones((batch,), jnp.int32))

        def cond(c):
            return (c[0] < max_new_tokens) & ~jnp.all(c[4])

        def body(c):
            step, tok, cache, record, done, length = c
            p = (lens + step - 1)[:, None]
            o = model(tok[:, None], p, jnp.ones_like(p), cache)
            new = pick(model, o.hidden[:, 0], jax.random.fold_in(key, step), temperature, trunc)
            new = tuple(jnp.where(done, f, x) for f, x in zip(fill, new))
            record = tuple(r.at[:, step].set(x) for r, x in zip(record, new))
            length = length + (~done).astype(jnp.int32)
            return (step + 1, new[0], _along_batch(o.cache), record,
                    done | jnp.isin(new[0], stops), length)

        _, _, _, record, done, length = jax.lax.while_loop(cond, body, carry)
        return (*record, length, done)

    if placement is None or not placement.sharded:
        return jax.jit(generate)
    rows, rep = placement.batch, placement.replicated
    return placement.jit(generate, in_shardings=(placement.params, rows, rows, rep, rep, rep,
                                                 (rep,) * len(Truncation._fields)),
                         out_shardings=(rows,) * 6)


class Generator:
    """Samples completions with the KV cache; built once per run, it owns its compiled
    decoders (one per sampler path: the chunked Gumbel-max, and the full-logits truncated
    path when ``truncation`` is active).

    Args:
      mdef: the policy's model definition.
      max_new_tokens: completion budget T.
      stop_ids: generation of a row ends after any of these.
      num_valid: only ids below it are sampled.
      truncation: top-k / top-p / min-p settings (None: none); used whenever
        ``temperature > 0`` (greedy is untruncated).
      placement: the run's placement: on a multi-device mesh the rollouts are sharded
        (see the module docstring) and ``params`` should be in its parameter shardings
        (``Placement.place_params``; on one process others are moved there); None or one
        device: plain ``jax.jit``.
    """

    def __init__(self, mdef: ModelDef, *, max_new_tokens: int, stop_ids: tuple[int, ...],
                 num_valid: int, truncation: Truncation | None = None,
                 placement: Placement | None = None):
        self.mdef, self.max_new_tokens = mdef, max_new_tokens
        self.truncation = Truncation() if truncation is None else Truncation(*truncation)
        self.stop_ids, self.num_valid = tuple(stop_ids), int(num_valid)
        self.placement = placement if placement is not None and placement.sharded else None
        self._decoders: dict[bool, object] = {}

    def _decoder(self, truncated: bool):
        if truncated not in self._decoders:
            self._decoders[truncated] = _decoder(self.mdef, self.max_new_tokens, truncated,
                                                 self.stop_ids, self.num_valid, self.placement)
        return self._decoders[truncated]

    def _inputs(self, prompts, key, temperature: float, truncation: Truncation | None):
        """``(decoder, its arguments but params, rows, truncated)`` of one call (rows:
        the real row count; the arguments' rows are padded to the batch shards)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        trunc = (self.truncation if truncation is None else Truncation(*truncation)).check()
        prompts = list(prompts)
        if not prompts or not all(len(p) for p in prompts):
            raise ValueError(f"need at least one prompt, each of >= 1 token; got prompt "
                             f"lengths {[len(p) for p in prompts]}")
        padded, lens = pad_prompts(prompts)
        rows = len(prompts)
        if self.placement is not None:
            extra = -rows % self.placement.batch_shards  # copies of row 0, dropped after
            padded = np.concatenate([padded, np.repeat(padded[:1], extra, axis=0)])
            lens = np.concatenate([lens, np.repeat(lens[:1], extra)])
            b = place_batch({"prompts": padded, "lens": lens}, self.placement.mesh)
            padded, lens = b["prompts"], b["lens"]
        truncated = trunc.active and temperature > 0
        args = (jnp.int32(trunc.top_k), jnp.float32(trunc.top_p), jnp.float32(trunc.min_p))
        return (self._decoder(truncated),
                (padded, lens, jnp.int32(rows), key, jnp.float32(temperature), args), rows,
                truncated)

    def lower(self, params: Params, prompts, key: jax.Array, *, temperature: float,
              truncation: Truncation | None = None):
        """The decoder of ``__call__``'s arguments, lowered (``jax.stages.Lowered``: its
        HLO, ``.compile()`` and memory analysis); same arguments and errors."""
        fn, args, _, _ = self._inputs(prompts, key, temperature, truncation)
        return fn.lower(params, *args)

    def __call__(self, params: Params, prompts, key: jax.Array, *, temperature: float,
                 truncation: Truncation | None = None) -> Rollout:
        """Sample one completion per prompt.

        Args:
          params: the policy's parameters.
          prompts: token id sequences (``B`` of them, any lengths >= 1).
          key: PRNG key (step ``t`` draws with ``fold_in(key, t)``; the same on every
            process).
          temperature: ``> 0`` samples, 0 is greedy.
          truncation: overrides the generator's for this call (same compiled decoder
            whenever both are active).

        Returns:
          ``Rollout`` (host arrays ``[B, ...]``; on several processes every process reads
          every row).

        Raises:
          ValueError: ``temperature < 0``, a truncation setting out of range
            (``Truncation.check``), no prompts or an empty one (the values named).
        """
        fn, args, rows, truncated = self._inputs(prompts, key, temperature, truncation)
        out = to_host(fn(params, *args))  # every process reads every row
        return Rollout(*(x[:rows] for x in out), PATH_TRUNCATED if truncated else PATH_GUMBEL)
