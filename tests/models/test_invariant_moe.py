"""``ModelConfig.numerics = "invariant"`` on an MoE model (the ``tiny-moe`` preset; issue
#41, "True on-policy rollouts": with ``tiny-moe`` in bf16 the GRPO loop's
``logprob_diff_max`` reached 0.225 in one step, a routing flip the likely cause).

The router, the experts and the combine run per row tile (``models.moe.invariant``), so a
token chooses the same experts and gets the same bits in any batch: the sampler's
log-probs equal the trainer's (packed rows, micro-batches, buckets) bit for bit with both
engines, G > 1, uneven prompts and per-row budgets, in float32 and bf16; the experts the
trainer's forward chooses are those of the decoder's prefill and decode steps at every
layer. With the mode off the same comparison shows the gap.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import get_config
from models.invariant import ROW_TILE, row_tiled
from models.moe import invariant as moe_invariant
from models.moe.experts import expert_ffn
from models.moe.invariant import EXPERT_TILE, expert_tiles, tile_bound
from models.moe.layer import MoE
from models.transformer import check_ops
from tests.models.test_invariant_memory import _largest
from tests.models.test_invariant_numerics import (
    ENGINES,
    G,
    T,
    _policy,
    _rollout,
    _trainer_logprobs,
)
from tests.support.models import random_model
from train.rl import packing

MOE = "tiny-moe"


# every case in the slow set: the default run keeps the property in
# tests/models/test_invariant_mesh.py::test_sampler_logprobs_are_the_trainers_on_a_mesh
# [moe_fsdp_expert] (bf16 MoE, compact engine: the one-device sampler's log-probs equal the
# mesh sampler's, the mesh trainer's and the one-device trainer's bit for bit); the waiting
# engine stays in the dense model's default cases (test_invariant_numerics.py)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_moe_sampler_logprobs_are_the_trainers_bit_for_bit(engine, dtype):
    """The issue's acceptance for MoE: every completion token's sampler log-prob equals
    the trainer's, ``np.array_equal`` (sampled at temperature 0.7)."""
    prompts, roll = _rollout(dtype, "invariant", engine, 0.7, MOE)
    assert (roll.lengths > 1).sum() > len(roll.lengths) // 2  # completions to compare
    trainer = _trainer_logprobs(dtype, "invariant", prompts, roll, 0.7, MOE)
    np.testing.assert_array_equal(trainer, roll.logprobs)


# slow: greedy draws are the trainer's on the dense model by default
# (test_invariant_numerics.py, temperature 0 on every engine) and the MoE's sampled draws above
@pytest.mark.slow
def test_moe_greedy_draws_are_the_trainers():
    """Greedy draws in bf16 on the compact engine: bit for bit against the trainer (the
    default set's MoE greedy case; the next test adds every engine)."""
    prompts, roll = _rollout("bfloat16", "invariant", "compact", 0.0, MOE)
    trainer = _trainer_logprobs("bfloat16", "invariant", prompts, roll, 1.0, MOE)
    np.testing.assert_array_equal(trainer, roll.logprobs)


# in the slow set: the compact engine's greedy case above and the dense engines' agreement
# run by default
@pytest.mark.slow
def test_moe_greedy_and_engines_agree():
    """Greedy draws in bf16: bit for bit against the trainer, and the same tokens and
    log-probs from every engine (so from any row, batch and admission order)."""
    rolls = []
    for engine in ENGINES:
        prompts, roll = _rollout("bfloat16", "invariant", engine, 0.0, MOE)
        trainer = _trainer_logprobs("bfloat16", "invariant", prompts, roll, 1.0, MOE)
        np.testing.assert_array_equal(trainer, roll.logprobs)
        rolls.append(roll)
    for other in rolls[1:]:
        np.testing.assert_array_equal(other.tokens, rolls[0].tokens)
        np.testing.assert_array_equal(other.logprobs, rolls[0].logprobs)


# slow: by default the dense model's gap shows the whole-rollout comparison can fail
# (test_invariant_numerics.py) and test_batch_dependent_grouped_matmuls_fail_the_tile_test
# the MoE tile's
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_default_numerics_have_the_gap(dtype):
    """The same comparison with the mode off: the log-probs differ, so the tests above
    can fail."""
    prompts, roll = _rollout(dtype, "default", "compact", 0.7, MOE)
    trainer = _trainer_logprobs(dtype, "default", prompts, roll, 0.7, MOE)
    assert np.abs(trainer - roll.logprobs).max() > 0


@nnx.jit
def _captured(model, *args):
    return nnx.capture(model, nnx.Intermediate)(*args)


def _routed(model, *args):
    """``model(*args)`` and the experts it chose, one int32 ``[B, S, k]`` per MoE layer in
    layer order (``MoE.tiled_stats``'s ``nnx.Intermediate``, under ``nnx.capture``)."""
    out, sown = _captured(model, *args)
    flat = sorted(nnx.to_flat_state(sown), key=lambda kv: int(kv[0][1]))
    assert [path[-1] for path, _ in flat] == ["experts"] * len(flat), flat
    return out, [np.asarray(v.get_value()[0]) for _, v in flat]


# float32 in the slow set: bf16, the presets' dtype, is where routes flip most easily
@pytest.mark.parametrize("dtype", [pytest.param("float32", marks=pytest.mark.slow), "bfloat16"])
def test_moe_trainer_and_decoder_choose_the_same_experts(dtype):
    """At every MoE layer, each completion token's experts in the trainer's forward
    (packed rows of 96 tokens, two micro-batches) are those of the decoding forward that
    produced it: the prompts' prefill (right-padded, G rows each, a KV cache) for the
    first, then one decode step per token (the reference engine's calls)."""
    mdef, params = _policy(dtype, "invariant", MOE)
    prompts, roll = _rollout(dtype, "invariant", "reference", 0.7, MOE)
    model = mdef.merge(params)
    n = len(roll.lengths)
    lens = np.array([len(prompts[i // G]) for i in range(n)])
    width = int(lens.max())
    tokens = np.zeros((n, width), np.int32)
    for i in range(n):
        tokens[i, :lens[i]] = prompts[i // G]
    pos = np.broadcast_to(np.arange(width, dtype=np.int32), tokens.shape)
    seg = jnp.asarray(pos < lens[:, None], jnp.int32)
    out, prefill = _routed(model, jnp.asarray(tokens), jnp.asarray(pos), seg,
                           model.init_cache(n, width + T))
    cache, steps = out.cache, []
    for t in range(1, T):
        p = jnp.asarray(lens + t - 1, jnp.int32)[:, None]
        out, chosen = _routed(model, jnp.asarray(roll.tokens[:, t - 1:t]), p,
                              jnp.ones_like(p), cache)
        cache = out.cache
        steps.append(chosen)
    layers = len(prefill)
    assert layers == get_config(MOE).num_hidden_layers
    # the decoder's experts for sequence i: its last prompt token, then its tokens
    decoder = [[np.concatenate([prefill[layer][i, lens[i] - 1][None]] +
                               [steps[t][layer][i] for t in range(roll.lengths[i] - 1)])
                for i in range(n)] for layer in range(layers)]

    completions = [roll.completion(i) for i in range(n)]
    batch = packing.pack([prompts[i // G] for i in range(n)], completions, 96,
                         row_multiple=2)
    half = batch.tokens.shape[0] // 2
    parts = []
    for part in (batch.rows(0, half), batch.rows(half, 2 * half)):
        parts.append(_routed(model, *(jnp.asarray(x) for x in (
            part.tokens, part.positions, part.segment_ids)))[1])
    for layer in range(layers):
        chosen = np.concatenate([p[layer] for p in parts])  # [rows, 96, k]
        per_slot = [batch.per_sequence(chosen[..., j]) for j in range(chosen.shape[-1])]
        for i in range(n):
            trainer = np.stack([s[i] for s in per_slot], -1)
            np.testing.assert_array_equal(trainer, decoder[layer][i],
                                          err_msg=f"layer {layer}, sequence {i}")


def _moe_and_input(dtype, seed=0, tokens=37):
    cfg = get_config(MOE, dtype=dtype, numerics="invariant")
    moe = random_model(cfg, seed=seed).layers[0].mlp
    assert isinstance(moe, MoE)
    x = jax.random.normal(jax.random.key(seed), (tokens, cfg.hidden_size), jnp.float32)
    return cfg, moe, x.astype(dtype)


def _block(moe, x, mask):
    """The invariant block on ``x [T, H]`` as the decoder runs it: the router on row
    tiles, then ``MoE.residual_block`` on a zero residual stream; ``(y, probs,
    experts)``."""
    probs, weights, experts = row_tiled(moe.route_tile, x, lead=1)
    y = moe.residual_block(jnp.zeros_like(x)[None], x[None], weights[None], experts[None],
                           mask[None])
    return y[0], probs, experts


def _float64_moe(cfg, moe, x):
    """The MoE block in float64 numpy: softmax top-k routing, renormalised, SwiGLU per
    chosen expert, weighted sum (``transformers``' ``Qwen3MoeSparseMoeBlock``)."""
    x = np.asarray(x, np.float64)
    router, gate, up, down = (np.asarray(p[...], np.float64) for p in
                              (moe.router, moe.gate_proj, moe.up_proj, moe.down_proj))
    logits = x @ router
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1, kind="stable")[:, :cfg.num_experts_per_tok]
    w = np.take_along_axis(probs, top, -1)
    w /= w.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(top[t]):
            g = x[t] @ gate[e]
            out[t] += w[t, j] * ((g / (1 + np.exp(-g))) * (x[t] @ up[e])) @ down[e]
    return out, top


def test_moe_tile_matches_a_float64_reference():
    """The tiled block on random float32 data (3 tiles, the last partly padding) against
    float64: the same experts, the outputs to float32 rounding; masked tokens give 0."""
    cfg, moe, x = _moe_and_input("float32")
    mask = jnp.arange(x.shape[0]) != 5
    y, _, experts = _block(moe, x, mask)
    want, top = _float64_moe(cfg, moe, x)
    np.testing.assert_array_equal(np.asarray(experts)[np.asarray(mask)],
                                  top[np.asarray(mask)])
    np.testing.assert_allclose(np.asarray(y)[np.asarray(mask)], want[np.asarray(mask)],
                               rtol=1e-4, atol=1e-6)
    assert not np.asarray(y)[5].any()


def test_moe_block_gradients_match_the_default_path():
    """Gradients through the tiled block (router weights included) against the default
    MoE's (``MoE.__call__``) on random float32 data: the same function, so equal to float
    rounding."""
    _, moe, x = _moe_and_input("float32")
    graph, params = nnx.split(moe)
    mask = jnp.ones(x.shape[:1], bool)
    cot = jax.random.normal(jax.random.key(1), x.shape)

    def tiled(x, params):
        return jnp.sum(_block(nnx.merge(graph, params), x, mask)[0] * cot)

    def default(x, params):
        return jnp.sum(nnx.merge(graph, params)(x[None], mask[None])[0][0] * cot)

    got = jax.grad(tiled, (0, 1))(x, params)
    want = jax.grad(default, (0, 1))(x, params)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_moe_token_bits_do_not_depend_on_its_neighbours(dtype):
    """A token's output, experts and router probabilities are bit-identical alone, at
    another row of another tile among other tokens, and beside a NaN token (which the
    tile's other rows never read)."""
    _, moe, x = _moe_and_input(dtype)
    mask = jnp.ones(x.shape[:1], bool)
    full = _block(moe, x, mask)
    alone = _block(moe, x[7:8], mask[7:8])
    perm = np.random.default_rng(0).permutation(x.shape[0])
    moved = _block(moe, x[perm], mask)
    poisoned = _block(moe, x.at[6].set(jnp.nan), mask)
    where = int(np.nonzero(perm == 7)[0][0])
    assert where // ROW_TILE != 7 // ROW_TILE or where % ROW_TILE != 7 % ROW_TILE
    for a, b, c, d in zip(full, alone, moved, poisoned):
        np.testing.assert_array_equal(a[7], b[0])
        np.testing.assert_array_equal(a[7], c[where])
        np.testing.assert_array_equal(a[7], d[7])


#: (H, I) of the expert-tile tests: at each of the two, one of the batch-dependent
#: alternatives below moves a token's bits with its batch on XLA:CPU.
WIDTHS = ((256, 128), (1024, 768))
E, K, N = 4, 2, 97


def _experts_and_tokens(hidden, inter, dtype):
    ks = jax.random.split(jax.random.key(hidden), 5)
    gate, up = (jax.random.normal(k, (E, hidden, inter)) / 16 for k in ks[:2])
    down = jax.random.normal(ks[2], (E, inter, hidden)) / 20
    x = jax.random.normal(ks[3], (N, hidden))
    experts = jax.vmap(lambda k: jax.random.permutation(k, E)[:K])(
        jax.random.split(ks[4], N)).astype(jnp.int32)
    return x.astype(dtype), experts, *(w.astype(dtype) for w in (gate, up, down))


def _grouped_matmul(x, experts, mask, gate, up, down):
    """Per-pair outputs from the default path's grouped matmul (the batch's pairs sorted
    by expert, ``ragged_dot``; ``models.moe.reference.dropless_experts`` uncombined)."""
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
    out = expert_ffn(x[order // K], sizes, gate, up, down).astype(x.dtype)
    return out[jnp.argsort(order)].reshape(x.shape[0], K, -1)


def _group_gemm(x, experts, mask, gate, up, down):
    """Per-pair outputs from one product per expert over all the batch's rows (a grouped
    GEMM whose row count is the batch's)."""
    flat, out = experts.reshape(-1), jnp.zeros((x.size // x.shape[1] * K, x.shape[1]),
                                               x.dtype)
    for e in range(E):
        order = jnp.argsort(flat != e, stable=True)  # expert e's pairs first
        rows = x[order // K]
        y = (jax.nn.silu(rows @ gate[e]) * (rows @ up[e])) @ down[e]
        out = jnp.where((flat == e)[:, None], y[jnp.argsort(order)], out)
    return out.reshape(x.shape[0], K, -1)


def _moved_elements(per_pair, hidden, inter, dtype="float32") -> int:
    """How many elements of token 7's pair outputs differ from the whole batch's when it
    is computed alone, with one other token, in the batch permuted (another place in
    its experts' tiles), in the batch twice over, and beside a NaN token."""
    x, experts, *weights = _experts_and_tokens(hidden, inter, dtype)
    f = jax.jit(per_pair)

    def run(rows):
        rows = np.asarray(rows)
        return np.asarray(f(x[rows], experts[rows], jnp.ones(len(rows), bool), *weights))

    full = run(np.arange(N))[7]
    perm = np.random.default_rng(0).permutation(N)
    moved = [run([7])[0], run([7, 30])[0], run(perm)[int(np.nonzero(perm == 7)[0][0])],
             run(np.tile(np.arange(N), 2))[N + 7]]
    poisoned = np.asarray(f(x.at[6].set(jnp.nan), experts, jnp.ones(N, bool), *weights))[7]
    return int(sum((m.view(np.uint8) != full.view(np.uint8)).sum() for m in
                   moved + [poisoned]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hidden,inter", WIDTHS)
def test_expert_tile_bits_do_not_depend_on_the_batch(hidden, inter, dtype):
    """``expert_tiles``: a (token, slot) pair's output bits are the same alone, beside
    one other token, at another place of its expert's tiles, in a batch twice as large
    and beside a NaN token: each tile is one fixed-shape product per projection."""
    assert _moved_elements(expert_tiles, hidden, inter, dtype) == 0


def test_batch_dependent_grouped_matmuls_fail_the_tile_test():
    """The comparison above fails for the grouped products it replaces (issue #41: the
    default path's bits move with the batch): the ``ragged_dot`` of the default path or
    one product per expert over the batch's rows each move token 7's bits at one of the
    widths, so replacing the tiles by either fails
    ``test_expert_tile_bits_do_not_depend_on_the_batch``."""
    for alternative in (_grouped_matmul, _group_gemm):
        assert sum(_moved_elements(alternative, *w) for w in WIDTHS) > 0, alternative


def test_expert_tiles_are_dropless_and_masked():
    """Every real pair is computed (against the float64 SwiGLU of its token and expert,
    float32 rounding), in at most ``tile_bound`` tiles; masked tokens' pairs and pairs of
    experts not held here (``first``) are ``-0.0`` (so a sum over the holders is exact)."""
    x, experts, gate, up, down = _experts_and_tokens(256, 128, "float32")
    mask = jnp.arange(N) % 5 != 0
    out = np.asarray(jax.jit(expert_tiles)(x, experts, mask, gate, up, down))
    x64, g64, u64, d64 = (np.asarray(a, np.float64) for a in (x, gate, up, down))
    for t in range(N):
        for j in range(K):
            if not mask[t]:
                assert np.array_equal(out[t, j].view(np.uint32),
                                      np.full(256, 0x80000000, np.uint32))
                continue
            e = int(experts[t, j])
            g = x64[t] @ g64[e]
            want = (g / (1 + np.exp(-g)) * (x64[t] @ u64[e])) @ d64[e]
            np.testing.assert_allclose(out[t, j], want, rtol=2e-4, atol=2e-5)
    # the experts 2, 3 held here: the others' pairs are -0.0, the held ones the same bits
    half = np.asarray(jax.jit(expert_tiles)(x, experts, mask, gate[2:], up[2:], down[2:],
                                             2))
    held = np.asarray(experts >= 2) & np.asarray(mask)[:, None]
    np.testing.assert_array_equal(half[held], out[held])
    assert np.signbit(half[~held]).all() and not half[~held].any()
    assert tile_bound(N * K, E) == -(-N * K // EXPERT_TILE) + E


def test_moe_block_bits_do_not_depend_on_its_rounds(monkeypatch):
    """The block takes a device's tokens in rounds (``tokens_per_round``, bounding its
    tile buffer): rounds of 5 tokens (8 of them, the last padded) give the bits of one
    round of all 37."""
    _, moe, x = _moe_and_input("bfloat16")
    mask = jnp.arange(x.shape[0]) != 5
    whole = _block(moe, x, mask)[0]
    monkeypatch.setattr(moe_invariant, "tokens_per_round", lambda *a, **k: 5)
    np.testing.assert_array_equal(_block(moe, x, mask)[0], whole)


def test_moe_block_holds_one_rounds_tile_buffer():
    """The tile buffer is static and one round's (``tokens_per_round``): in the jaxpr of
    the block's forward on 65,536 tokens no value is larger than its pair outputs
    ``[T, k, H]``, where one tile buffer for all of them (``tile_bound(T k, E)`` tiles of
    32 rows) would be."""
    cfg = get_config(MOE, dtype="bfloat16", numerics="invariant")
    moe = random_model(cfg).layers[0].mlp
    t, k, h = 65536, cfg.num_experts_per_tok, cfg.hidden_size
    assert tile_bound(t * k, cfg.num_experts) * EXPERT_TILE > t * k  # the bound it checks

    def arg(shape, dtype):
        return jax.ShapeDtypeStruct((1, t, *shape), dtype)

    jaxpr = jax.make_jaxpr(lambda *a: moe_invariant.on_mesh(*a, *moe._weights()))(
        arg((h,), jnp.bfloat16), arg((h,), jnp.bfloat16), arg((k,), jnp.float32),
        arg((k,), jnp.int32), arg((), bool))
    largest, what = _largest(jaxpr.jaxpr)
    assert largest <= t * k * h, what


def test_check_ops_accepts_moe_and_refuses_what_has_no_invariant_variant():
    """MoE layers run in the mode now; an all-to-all dispatch or a capacity factor (drops
    decided by the other tokens) is refused, the field and value named."""
    check_ops(get_config(MOE, numerics="invariant"))
    check_ops(get_config(MOE, numerics="invariant", moe_token_chunk=8))
    with pytest.raises(ValueError, match="expert_dispatch='dense'"):
        check_ops(get_config(MOE, numerics="invariant", expert_dispatch="dense"))
    with pytest.raises(ValueError, match="expert_capacity_factor=1.5"):
        check_ops(get_config(MOE, numerics="invariant", expert_capacity_factor=1.5))

