"""``ModelConfig.numerics = "invariant"``: the sampler's log-probs of a completion equal
the trainer's log-probs of the same tokens bit for bit (``np.array_equal``), in float32
and bf16, with both rollout engines (issue #41, "True on-policy rollouts": in float32 a
completion's sampler log-probs moved by 1-7 ulps with the batch it was drawn in, in bf16
the GRPO loop's ``logprob_diff_max`` was 0.025-0.033 per step).

The trainer's side is ``Transformer.token_logprobs`` on packed rows (several sequences
per row, segment ids), split into micro-batches of rows, each compacted into its own
bucket: what the GRPO step computes. The rollouts: G = 2 samples per prompt, uneven
prompts at page and key-block edges, per-row budgets, continuous batching, greedy and
sampled. With the mode off the same comparison shows the gap. What the mode does not
cover is refused by name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import get_config
from models.attention import invariant as inv_attention
from models.attention.reference import dense_attention
from models.invariant import ROW_TILE, UNROLL, check_mesh, row_tiled
from models.transformer import check_ops
from tests.models.test_attention import packed
from tests.support.models import random_model
from train.rl import packing, rollout, state
from train.rl.placement import place_batch

T, G, PAGE = 8, 2, 4
KB = inv_attention.KEY_BLOCK
#: lengths at page edges (3, 4, 5, 8), below and past a key block (KB - 1, KB + 1), one
#: that alone fills a row tile
PROMPT_LENGTHS = (3, 4, 5, 8, ROW_TILE + 1, KB - 1, KB + 1)
STOPS = tuple(range(0, 500, 29))
ENGINES = {"reference": {"engine": "reference"},
           "compact": {"engine": "compact", "page_size": PAGE},
           "waiting": {"engine": "compact", "page_size": PAGE, "max_decode_rows": 3}}


@functools.cache
def _policy(dtype: str, numerics: str, preset: str = "tiny"):
    cfg = get_config(preset, dtype=dtype, tie_word_embeddings=False, numerics=numerics)
    model = random_model(cfg, seed=3)
    return state.ModelDef.of(model.cfg), state.params_of(model)


#: A truncated draw: top-k, top-p and min-p at once (the support is their intersection).
TRUNCATION = rollout.Truncation(top_k=40, top_p=0.9, min_p=0.02)


@functools.cache
def _generator(dtype: str, numerics: str, engine: str, preset: str = "tiny",
               placement=None) -> rollout.Generator:
    mdef, _ = _policy(dtype, numerics, preset)
    return rollout.Generator(mdef, max_new_tokens=T, stop_ids=STOPS, num_valid=500,
                             decode_chunk=3, rung_multiple=4, placement=placement,
                             **ENGINES[engine])


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(20, 500, n).tolist() for n in PROMPT_LENGTHS]


@functools.cache
def _scorer(mdef, placement=None):
    def score(params, b, bucket, temperature):
        min_logit = None  # a truncated rollout's support, as train.steps reads it
        if "min_logit" in b:
            min_logit = jnp.where(b["loss_mask"] > 0, b["min_logit"], -jnp.inf)
        head, _ = mdef.merge(params).token_logprobs(
            b["tokens"], b["positions"], b["segment_ids"], b["labels"],
            packing.keep(b["loss_mask"], b["segment_ids"]), temperature=temperature,
            bucket=bucket, min_logit=min_logit)
        return head.logprobs

    static = ("bucket", "temperature")
    if placement is None:
        return jax.jit(score, static_argnames=static)
    return placement.jit(score, static_argnames=static)


def _trainer_logprobs(dtype, numerics, prompts, roll, temperature, preset="tiny",
                      placement=None):
    """The trainer's log-probs of every completion, as the sampler's ``[B, T]`` layout:
    the sequences packed into rows of 96 tokens, two micro-batches of rows, each with the
    bucket of its own kept tokens (on a mesh: its fullest shard's), scored on the
    sampler's support when the rollout was truncated (``loss.logprob_support =
    "sampler"``)."""
    mdef, params = _policy(dtype, numerics, preset)
    completions = [roll.completion(i) for i in range(len(roll.lengths))]
    values = None
    if np.isfinite(roll.min_logit).any():
        values = {"min_logit": [roll.min_logit[i, :len(c)] for i, c in
                                enumerate(completions)]}
    shards = 1 if placement is None else placement.batch_shards
    batch = packing.pack([prompts[i // G] for i in range(len(completions))], completions,
                         96, row_multiple=2 * shards, values=values)
    half = batch.tokens.shape[0] // 2
    score = _scorer(mdef, placement)
    if placement is not None:
        params = placement.place_params(params)
    parts = []
    for part in (batch.rows(0, half), batch.rows(half, 2 * half)):
        if placement is None:
            arrays = {k: jnp.asarray(v) for k, v in part.arrays(*part.values).items()}
        else:
            arrays = place_batch(part.arrays(*part.values), placement.mesh)
        bucket = (part.bucket(ROW_TILE) if placement is None
                  else placement.bucket(part, ROW_TILE))
        parts.append(np.asarray(score(params, arrays, bucket, temperature)))
    out = np.zeros(roll.logprobs.shape, np.float32)
    for i, seq in enumerate(batch.per_sequence(np.concatenate(parts))):
        out[i, :len(seq)] = seq
    return out


def _rollout(dtype, numerics, engine, temperature, preset="tiny", truncation=None,
             placement=None, order=None):
    """The rollout of ``_prompts()`` (G per prompt, per-row budgets); ``order``: the
    prompts in that order, each under its own request id (the same requests, other
    rows)."""
    _, params = _policy(dtype, numerics, preset)
    prompts = _prompts()
    order = list(range(len(prompts))) if order is None else list(order)
    budgets = np.tile([T, T - 3], len(prompts))  # per-row budgets
    if placement is not None:
        params = placement.place_params(params)
    roll = _generator(dtype, numerics, engine, preset, placement)(
        params, [prompts[i] for i in order], jax.random.key(1), temperature=temperature,
        group_size=G, max_new_tokens=budgets, truncation=truncation, request_ids=order)
    return [prompts[i] for i in order], roll


# float32 on the reference and compact engines in the slow set (the waiting engine's
# float32 cases, which run the compact engine's steps, and every bf16 case stay)
# by default: bf16 (the presets' dtype) sampled on the compact and waiting engines and greedy
# on all three, float32 greedy on the waiting engine; the rest in the slow set
_DEFAULT_DRAWS = {(0.7, "bfloat16", "compact"), (0.7, "bfloat16", "waiting"),
                  *((0.0, "bfloat16", e) for e in ENGINES), (0.0, "float32", "waiting")}


@pytest.mark.parametrize("temperature, dtype, engine", [
    (t, d, e) if (t, d, e) in _DEFAULT_DRAWS else pytest.param(t, d, e, marks=pytest.mark.slow)
    for t in (0.7, 0.0) for d in ("float32", "bfloat16") for e in ENGINES])
def test_sampler_logprobs_are_the_trainers_bit_for_bit(engine, dtype, temperature):
    """The issue's acceptance: every completion token's sampler log-prob equals the
    trainer's (packed rows, micro-batches, buckets), ``np.array_equal``."""
    prompts, roll = _rollout(dtype, "invariant", engine, temperature)
    assert (roll.lengths > 1).sum() > len(roll.lengths) // 2  # completions to compare
    trainer = _trainer_logprobs(dtype, "invariant", prompts, roll, temperature or 1.0)
    np.testing.assert_array_equal(trainer, roll.logprobs)


def test_engines_draw_the_same_tokens_and_logprobs():
    """Under the mode a request's tokens and log-probs do not depend on the engine, its
    row, its batch or its admission order (bf16, sampled)."""
    rolls = [_rollout("bfloat16", "invariant", e, 0.7)[1] for e in ENGINES]
    for other in rolls[1:]:
        np.testing.assert_array_equal(other.tokens, rolls[0].tokens)
        np.testing.assert_array_equal(other.logprobs, rolls[0].logprobs)


# float32's gap (1-7 ulps) is in the slow set; bf16's shows the test can fail
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_default_numerics_have_the_gap(dtype):
    """The same comparison with the mode off: the log-probs differ (float rounding of
    other batch shapes), so the test above can fail."""
    prompts, roll = _rollout(dtype, "default", "compact", 0.7)
    trainer = _trainer_logprobs(dtype, "default", prompts, roll, 0.7)
    gap = np.abs(trainer - roll.logprobs)
    assert gap.max() > 0
    assert gap.max() < (0.1 if dtype == "bfloat16" else 1e-4)  # rounding, not a bug


def test_attention_matches_the_dense_reference():
    """The three front ends of the invariant attention against ``dense_attention`` on
    random float32 data: packed rows (several key blocks, padding), the dense cache with
    decode slots after a right-padded prompt, and a paged pool with scattered pages."""
    b, t, n, k, d = 2, 2 * KB + 9, 4, 2, 16
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, n, d))
    kk = jax.random.normal(keys[1], (b, t, k, d))
    vv = jax.random.normal(keys[2], (b, t, k, d))
    pos, seg = packed([(KB + 3, 40), (2 * KB + 9,)], t)
    want = dense_attention(q, kk, vv, pos, seg, pos, seg, scale=0.25)
    got = inv_attention.self_attention(q, kk, vv, pos, seg, scale=0.25)
    live = np.asarray(seg)[..., None, None] > 0
    np.testing.assert_allclose(np.where(live, got, 0), np.where(live, want, 0), rtol=2e-5,
                               atol=2e-6)
    # one query at position p of row 1 reading a cache whose slots are: prompt [0, 50),
    # padding [50, 60), decode [60, L): position x >= 50 at slot x + 10
    p, length = KB + 30, KB + 60
    slot_pos = np.where(np.arange(length) < 50, np.arange(length), np.arange(length) - 10)
    slot_seg = ((np.arange(length) < 50) | (np.arange(length) >= 60)).astype(np.int32)
    slot_seg &= slot_pos <= p
    src = np.clip(slot_pos, 0, t - 1)
    ck, cv = kk[1:, src], vv[1:, src]
    got = inv_attention.cache_attention(
        q[1:, p:p + 1], ck, cv, jnp.full((1, 1), p), jnp.ones((1, 1), jnp.int32),
        jnp.asarray(slot_pos)[None], jnp.asarray(slot_seg)[None], scale=0.25)
    np.testing.assert_allclose(got[0, 0], want[1, p], rtol=2e-5, atol=2e-6)
    # paged: pages of 8 slots, row 1's pages scattered over a pool of 40
    size = 8
    pages = -(-t // size)
    order = np.random.default_rng(0).permutation(40)[:pages]
    seq_k = jnp.pad(kk[1], ((0, pages * size - t), (0, 0), (0, 0)))
    seq_v = jnp.pad(vv[1], ((0, pages * size - t), (0, 0), (0, 0)))
    kp = jnp.zeros((40, k, size, d)).at[order].set(
        seq_k.reshape(pages, size, k, d).swapaxes(1, 2))
    vp = jnp.zeros((40, k, size, d)).at[order].set(
        seq_v.reshape(pages, size, k, d).swapaxes(1, 2))
    table = jnp.full((1, pages + 2), 2 ** 30, jnp.int32).at[0, :pages].set(order)
    got = inv_attention.paged_attention(q[1, p][None], kp, vp, table, jnp.array([p + 1]),
                                        0.25)
    np.testing.assert_allclose(got[0], want[1, p], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("overrides, named", [
    ({"numerics": "exact"}, "numerics"),
    ({"numerics": "invariant", "attention_impl": "xla_chunked"}, "xla_chunked"),
    ({"numerics": "invariant", "attention_impl": "dense"}, "'dense'"),
])
def test_check_ops_refuses_what_the_mode_cannot_run(overrides, named):
    with pytest.raises(ValueError, match=named):
        check_ops(get_config("tiny", **overrides))


def test_tensor_axis_is_refused():
    """The batch axes and context are covered; a tensor axis (split-K matmuls) is refused
    by name."""
    check_mesh(None)
    check_mesh(jax.sharding.AbstractMesh((2, 2, 2), ("data", "fsdp", "context")))
    with pytest.raises(ValueError, match="tensor=2"):
        check_mesh(jax.sharding.AbstractMesh((2, 2), ("fsdp", "tensor")))


# float32 in the slow set; bf16 (the presets' dtype) runs by default
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_truncated_draws_are_the_trainers_bit_for_bit(dtype):
    """Truncated draws under the mode (issue #41's acceptance lists "greedy / sampled /
    truncated draws"): each token's sampler log-prob on the support it was drawn from
    (``min_logit``) equals the trainer's scored on that support, ``np.array_equal``, with
    continuous batching; the draws are really truncated (finite thresholds)."""
    prompts, roll = _rollout(dtype, "invariant", "waiting", 0.9, truncation=TRUNCATION)
    live = np.arange(T) < roll.lengths[:, None]
    assert np.isfinite(roll.min_logit[live]).all() and (roll.logmass[live] < 0).any()
    trainer = _trainer_logprobs(dtype, "invariant", prompts, roll, 0.9)
    np.testing.assert_array_equal(trainer, roll.logprobs)


# slow: the default run keeps a moved request's draws in test_request_isolation.py::
# test_moved_request_draws_the_same_tokens[dense], a truncated draw's rows wherever they
# sit in tests/jaxhead/test_sampling.py::test_row_ids_draw_the_rows_of_the_whole_batch,
# and truncated draws under continuous batching in test_truncated_draws_are_the_trainers_*
@pytest.mark.slow
def test_truncated_request_draws_the_same_tokens_in_any_batch():
    """The same request draws the same truncated tokens and log-probs whatever rows and
    batch it runs in: the prompts reversed (each under its request id) and decoded with
    rows leaving and joining the batch (bf16)."""
    _, ref = _rollout("bfloat16", "invariant", "waiting", 0.9, truncation=TRUNCATION)
    order = list(reversed(range(len(PROMPT_LENGTHS))))
    _, moved = _rollout("bfloat16", "invariant", "compact", 0.9, truncation=TRUNCATION,
                        order=order)
    rows = np.concatenate([np.arange(G) + G * i for i in order])  # moved row -> ref row
    for key in ("tokens", "logprobs", "min_logit", "lengths"):
        np.testing.assert_array_equal(getattr(moved, key), getattr(ref, key)[rows], key)


def test_attention_gradients_match_the_dense_reference():
    """The training front end's gradients (``"xla_chunked"``'s backward) against
    ``dense_attention``'s on random float32 packed rows spanning several key blocks."""
    b, t, n, k, d = 2, KB + 20, 4, 2, 16
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (b, t, n, d))
    kk = jax.random.normal(keys[1], (b, t, k, d))
    vv = jax.random.normal(keys[2], (b, t, k, d))
    w = jax.random.normal(keys[3], (b, t, n, d))
    pos, seg = packed([(KB + 3, 10), (KB + 20,)], t)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.where(seg[..., None, None] > 0, fn(q, k, v), 0) * w)

    want = jax.grad(loss(lambda q, k, v: dense_attention(q, k, v, pos, seg, pos, seg,
                                                         scale=0.25)), (0, 1, 2))(q, kk, vv)
    got = jax.grad(loss(lambda q, k, v: inv_attention.self_attention(
        q, k, v, pos, seg, scale=0.25)), (0, 1, 2))(q, kk, vv)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def test_row_tiled_gradient_is_the_whole_batchs_in_one_pass():
    """``row_tiled``'s gradient (to its inputs and to the parameters ``fn`` closes over)
    is the untiled function's, on random float32 rows that leave a partial last tile, and
    its backward pass runs no loop of tiles: the update's cost in issue #41 (3.7x the
    default's CPU seconds, ``benchmarks/invariant.py``) was mostly the tiled backward."""
    keys = jax.random.split(jax.random.key(4), 4)
    x = jax.random.normal(keys[0], (3, 2 * ROW_TILE + 5, 8))
    pos = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape[:2])
    w = jax.random.normal(keys[1], (8, 12)) / 3
    bias = jax.random.normal(keys[2], (12,))
    c = jax.random.normal(keys[3], (*x.shape[:2], 12))

    def fn(x, p, w, bias):
        return jnp.tanh(x @ w + bias) * jnp.cos(p[..., None].astype(x.dtype))

    def loss(tiled):
        def f(x, w, bias):
            y = row_tiled(lambda x, p: fn(x, p, w, bias), x, pos) if tiled else fn(
                x, pos, w, bias)
            return jnp.sum(y * c)
        return f

    want = jax.grad(loss(False), (0, 1, 2))(x, w, bias)
    got = jax.grad(loss(True), (0, 1, 2))(x, w, bias)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5)
    # one loop: the forward's tiles; the backward is one pass over every row
    text = str(jax.make_jaxpr(jax.grad(loss(True), (0, 1, 2)))(x, w, bias))
    assert text.count("scan[") == 1, text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unrolled_tile_loop_keeps_each_tiles_bits(dtype):
    """``map_tiles`` runs ``UNROLL`` tiles per loop step (the update's cost in issue #41,
    ``benchmarks/invariant.py``): a row's result over many tiles, in the unrolled steps
    and in the remainder after them, is the bits of the same row computed in a call of
    one tile (a decode step's), on random rows and weights."""
    tiles = UNROLL + 3
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (tiles * ROW_TILE, 48), dtype)
    w = (jax.random.normal(keys[1], (48, 80)) / 7).astype(dtype)
    w2 = (jax.random.normal(keys[2], (80, 48)) / 9).astype(dtype)

    def fn(x):
        return jax.nn.silu(x @ w) @ w2

    whole = np.asarray(jax.jit(lambda x: row_tiled(fn, x, lead=1))(x), np.float32)
    one = jax.jit(lambda x: row_tiled(fn, x, lead=1))
    for i in (0, UNROLL - 1, UNROLL, tiles - 1):
        rows = x[i * ROW_TILE:(i + 1) * ROW_TILE]
        np.testing.assert_array_equal(
            whole[i * ROW_TILE:(i + 1) * ROW_TILE], np.asarray(one(rows), np.float32))
        # a row alone in its tile (the others padding) keeps its bits too
        np.testing.assert_array_equal(whole[i * ROW_TILE + 5],
                                      np.asarray(one(rows[5:6]), np.float32)[0])
