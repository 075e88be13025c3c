"""Rollouts for the trainer: the run's engine (``models.generate``) under its placement,
with host arrays in and out.

A ``Generator`` is built once per run (by ``train.grpo``) and owns its compiled functions;
``temperature`` is traced, so greedy and sampled calls share them. Its engine is
``compact`` (one prefill per prompt into a paged KV cache its samples share, finished rows
leave the batch between chunks of decode steps, at most ``max_decode_rows`` at once) or
``reference`` (the whole batch decodes until its longest row stops); both draw the same
tokens for the same key (``models.generate.api``).

Under a multi-device ``train.rl.placement.Placement`` each call runs as SPMD programs over the
run's mesh: the rows (padded to a multiple of the batch shards; padding rows are done from
the start and dropped after) are split over ``models.mesh.BATCH_AXES``, the parameters keep
their training shardings (the MoE runs expert-parallel, no device gathers another's
experts), the KV cache (the ``compact`` engine's page pool along its pages, each shard's
rows reading its own) and the sampled arrays are split along the batch, and every
process reads back every row (``to_host``: a ``process_allgather`` of the small ``[B, T]``
results, and of the ``compact`` engine's done flags between chunks, so every process takes
the same decisions and packs the same global batch). A row's sampling noise depends only
on the key, its request (the prompt's request id, by default its index in the call, and
the sample's index in its group) and the decode step (``models.generate.api.
request_key``), so completions do not depend on the device or process count, the padding,
the row a request runs in, nor on which rows share a batch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from models.generate import ENGINES, IMPLEMENTATIONS, Decoding, EngineSettings, Layout, Work
from models.generate import Truncation as EngineTruncation
from train.config import domains as d
from train.rl.placement import Placement, place_batch, to_host
from train.rl.state import ModelDef, Params

__all__ = ["PATH_GUMBEL", "PATH_TRUNCATED", "Generator", "Rollout", "Truncation",
           "pad_prompts"]

#: The ``sampling_path`` metric: which sampler drew a rollout's tokens.
PATH_GUMBEL = "chunked_gumbel_max"  # jaxhead's chunked Gumbel-max: no [B, V] logits
PATH_TRUNCATED = "full_logits_truncated"  # top-k / top-p / min-p from full float32 logits


#: ``loss.logprob_support``'s domain: the trainer scores a truncated rollout's tokens on
#: the support they were drawn from (``Rollout.min_logit``) or on the whole softmax
#: (``Rollout.logmass`` moves the sampler's log-probs to it).
LOGPROB_SUPPORT = d.one_of("sampler", "full")


#: ``rollout.engine``'s domain: the ``models.generate`` implementations.
ENGINE = d.one_of(*IMPLEMENTATIONS)


#: The domains of ``Truncation``'s fields (``rollout.top_k``, ``rollout.top_p``,
#: ``rollout.min_p``).
TOP_K = d.integer(0, note=" (0: off)")
TOP_P = d.number(0, 1, lo_open=True)
MIN_P = d.FRACTION_BELOW_1


class Truncation(EngineTruncation):
    """``models.generate.Truncation`` (``top_k``, ``top_p``, ``min_p``; 0, 1, 0: off) with
    the check of its fields' domains."""

    __slots__ = ()

    def check(self) -> Truncation:
        """``self`` if each field is in its domain (``TOP_K``, ``TOP_P``, ``MIN_P``).

        Raises:
          ValueError: the first field that is not, as the config check words it.
        """
        for name, domain in zip(self._fields, (TOP_K, TOP_P, MIN_P), strict=True):
            domain.require(f"rollout.{name}", getattr(self, name))
        return self


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
      prompt_routes, routes: with ``Generator(record_routes=True)`` (an MoE model), int32
        ``[B, W, M, k]`` and ``[B, T, M, k]``: the experts each prompt token and each
        completion token used at each of the M MoE layers in the sampler's forward
        (``models.generate.api.record_routes``: -1 where no token ran, e.g. a
        completion's last token); else None.
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    min_logit: np.ndarray
    logmass: np.ndarray
    lengths: np.ndarray
    stopped: np.ndarray
    path: str
    prompt_routes: np.ndarray | None = None
    routes: np.ndarray | None = None

    def completion(self, i: int) -> list[int]:
        """Tokens of completion ``i`` (stop token included)."""
        return self.tokens[i, : self.lengths[i]].tolist()

    def sequence_routes(self, i: int, prompt_len: int) -> np.ndarray:
        """int32 ``[prompt_len + lengths[i], M, k]``: the recorded experts of row ``i``'s
        prompt (its first ``prompt_len`` tokens) and completion tokens, in the order
        ``train.rl.packing`` lays them out (-1: none recorded, the last token's).

        Raises:
          ValueError: the rollout recorded no routes.
        """
        if self.routes is None:
            raise ValueError("this rollout recorded no routes: build the Generator with "
                             "record_routes=True (an MoE model)")
        return np.concatenate([self.prompt_routes[i, :prompt_len],
                               self.routes[i, : self.lengths[i]]])


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


class Generator:
    """Samples completions with the KV cache; built once per run, it owns its compiled
    functions (per sampler path: the chunked Gumbel-max, and the full-logits truncated
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
      engine: ``"compact"`` or ``"reference"`` (``models.generate.IMPLEMENTATIONS``).
      decode_chunk: ``compact``: decode steps between compactions.
      rung_multiple, rung_growth: ``compact``: its row ladder (``jaxhead.bucket_ladder``;
        on a mesh the multiple is raised to a multiple of the batch shards).
      page_size: ``compact``: slots per page of its paged KV cache.
      max_decode_rows: ``compact``: the most rows decoding at once (0: all); the others
        wait for the places finished rows free (continuous batching).
      record_routes: record the experts every token used at every MoE layer
        (``Rollout.routes``; routing replay and the expert disagreement metric): the
        rollout then holds ``M x k`` int32 per token of ``W + T`` (M MoE layers, top-k
        k) on the devices and the host.

    Attributes:
      last_work: the ``models.generate.Work`` of the latest call (None before one).

    Raises:
      ValueError: an unknown ``engine``, ``decode_chunk`` / ``page_size`` < 1,
        ``max_decode_rows`` < 0 or a bad ladder (named); ``record_routes`` for a dense
        model.
    """

    def __init__(self, mdef: ModelDef, *, max_new_tokens: int, stop_ids: tuple[int, ...],
                 num_valid: int, truncation: Truncation | None = None,
                 placement: Placement | None = None, engine: str = "compact",
                 decode_chunk: int = 64, rung_multiple: int = 8, rung_growth: float = 1.5,
                 page_size: int = 64, max_decode_rows: int = 0,
                 record_routes: bool = False):
        ENGINE.require("rollout.engine", engine)
        if record_routes and not mdef.cfg.is_moe:
            raise ValueError("record_routes=True needs an MoE model: this one is dense "
                             "(num_experts = 0), it has no routes to record")
        self.record_routes = bool(record_routes)
        self.mdef, self.max_new_tokens, self.engine = mdef, max_new_tokens, engine
        self.truncation = Truncation() if truncation is None else Truncation(*truncation)
        self.stop_ids, self.num_valid = tuple(stop_ids), int(num_valid)
        self.placement = placement if placement is not None and placement.sharded else None
        shards = 1 if self.placement is None else self.placement.batch_shards
        self.settings = EngineSettings(
            row_multiple=shards, chunk=decode_chunk,
            rung_multiple=math.lcm(rung_multiple, shards), growth=rung_growth,
            page_size=page_size, max_rows=max_decode_rows)
        self.decode_chunk = decode_chunk
        self._engines: dict = {}
        self.engine_for(False)  # checks the settings
        self.last_work: Work | None = None

    def _decoding(self, truncated: bool) -> Decoding:
        return Decoding(self.max_new_tokens, self.stop_ids, self.num_valid, truncated,
                        self.record_routes)

    def _jit(self, fn, **jit_kwargs):
        if self.placement is None:
            return jax.jit(fn, **jit_kwargs)
        return self.placement.jit(fn, **jit_kwargs)

    def engine_for(self, truncated: bool):
        """The engine of one sampler path (``models.generate.ENGINES[engine]``: every group
        size and row count), built once; its ``compiled(name, static)`` are its jitted
        functions (``.lower(...)``: their programs)."""
        if truncated not in self._engines:
            p = self.placement
            layout = None if p is None else Layout(p.params, p.batch, p.replicated)
            self._engines[truncated] = ENGINES[self.engine](
                self.mdef.merge, self._decoding(truncated), self.settings, jit=self._jit,
                read=to_host, place=self._place, layout=layout)
        return self._engines[truncated]

    def _inputs(self, prompts, temperature: float, truncation: Truncation | None,
                group_size: int, max_new_tokens):
        """``(padded prompts [U', W], lens [U'], budgets [B], truncated, settings)`` of one
        call, checked (``U'``: the prompts padded to a multiple of the batch shards)."""
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        trunc = (self.truncation if truncation is None else Truncation(*truncation)).check()
        if not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size must be a positive int, got {group_size!r}")
        prompts = list(prompts)
        if not prompts or not all(len(p) for p in prompts):
            raise ValueError(f"need at least one prompt, each of >= 1 token; got prompt "
                             f"lengths {[len(p) for p in prompts]}")
        rows = len(prompts) * group_size
        budgets = np.asarray(self.max_new_tokens if max_new_tokens is None else max_new_tokens)
        if budgets.ndim == 0:
            budgets = np.full(rows, budgets)
        if budgets.shape != (rows,) or budgets.dtype.kind not in "iu" or \
                budgets.min() < 1 or budgets.max() > self.max_new_tokens:
            raise ValueError(f"max_new_tokens must be ints in [1, {self.max_new_tokens}] "
                             f"(one, or one per row: {rows}), got {max_new_tokens!r}")
        padded, lens = pad_prompts(prompts)
        if self.placement is not None:
            extra = -len(prompts) % self.placement.batch_shards  # copies of prompt 0
            padded = np.concatenate([padded, np.repeat(padded[:1], extra, axis=0)])
            lens = np.concatenate([lens, np.repeat(lens[:1], extra)])
        truncated = trunc.active and temperature > 0
        args = (jnp.int32(trunc.top_k), jnp.float32(trunc.top_p), jnp.float32(trunc.min_p))
        return padded, lens, budgets.astype(np.int32), truncated, args

    def _place(self, arrays: dict) -> dict:
        return place_batch(arrays, None if self.placement is None else self.placement.mesh)

    def lower(self, params: Params, prompts, key: jax.Array, *, temperature: float,
              truncation: Truncation | None = None, group_size: int = 1):
        """The engine's program of ``__call__``'s arguments, lowered (``jax.stages.Lowered``:
        its HLO, ``.compile()`` and memory analysis); same arguments and errors. An engine
        that runs one program per call lowers it (``reference``).

        Raises:
          ValueError: an engine that runs several programs a call (``compact``: lower each
            with ``engine_for(...).compiled(name, static).lower(...)``).
        """
        padded, lens, budgets, truncated, trunc = self._inputs(
            prompts, temperature, truncation, group_size, None)
        return self.engine_for(truncated).lower(params, padded, lens, budgets, key,
                                                temperature, trunc, group_size=group_size)

    def __call__(self, params: Params, prompts, key: jax.Array, *, temperature: float,
                 truncation: Truncation | None = None, group_size: int = 1,
                 max_new_tokens=None, request_ids=None) -> Rollout:
        """Sample ``group_size`` completions per prompt.

        Args:
          params: the policy's parameters.
          prompts: token id sequences (``U`` of them, any lengths >= 1); row ``r`` of the
            result continues prompt ``r // group_size``.
          key: PRNG key (sample ``j`` of request ``i`` draws step ``t`` with
            ``models.generate.api.request_key(key, i, j, t)``; the same on every process).
          temperature: ``> 0`` samples, 0 is greedy.
          truncation: overrides the generator's for this call (same compiled decoder
            whenever both are active).
          group_size: G, samples per prompt (each prompt is prefilled once by ``compact``).
          max_new_tokens: None (the generator's T), or an int or int ``[U x G]`` per-row
            budgets in ``[1, T]``.
          request_ids: None (prompt ``i`` is request ``i``) or ``U`` distinct ints in
            ``[0, 2**31)``: a prompt's samples then draw the same tokens in any call that
            gives it the same id (whatever its place, batch or device count; the logits
            equal to float rounding).

        Returns:
          ``Rollout`` (host arrays ``[U x G, ...]``; on several processes every process
          reads every row).

        Raises:
          ValueError: ``temperature < 0``, a truncation setting out of range
            (``Truncation.check``), no prompts or an empty one, a bad ``group_size``,
            budget or ``request_ids`` (the values named).
        """
        padded, lens, budgets, truncated, trunc = self._inputs(
            prompts, temperature, truncation, group_size, max_new_tokens)
        rows = len(budgets)
        if self.placement is not None:
            params = self.placement.place_params(params)
        out, self.last_work = self.engine_for(truncated)(
            params, padded, lens, budgets, key, np.float32(temperature), trunc,
            group_size=group_size, request_ids=request_ids)
        out = to_host(out)  # every process reads every row
        path = PATH_TRUNCATED if truncated else PATH_GUMBEL
        return Rollout(*(x[:rows] for x in out[:6]), path, *(x[:rows] for x in out[6:]))
