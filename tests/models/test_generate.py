"""The rollout engines (``models.generate``, driven by ``train.rl.rollout.Generator``): the
``compact`` engine draws the ``reference`` engine's tokens for the same key (G > 1, uneven
prompt lengths, per-row budgets, stop tokens, untruncated / truncated / greedy), and does
the work it should: each prompt prefilled once, decode row-steps that follow the rows'
lengths through the row ladder, a paged KV cache that holds what the rows wrote (the G
samples of a prompt share its full pages). ``waiting`` is ``compact`` with fewer places
than rows (continuous batching: rows start at different steps, each with its own key).

The 8-device mesh case is ``tests/train/test_sharded_rollout.py``."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxhead
from models import get_config
from models.generate.compact import next_chunk
from tests.support.models import random_model
from train.rl import rollout, state

T, G, CHUNK, MULTIPLE, GROWTH, PAGE = 12, 3, 3, 4, 1.5, 4
#: engine name -> (``Generator`` engine, its paging arguments)
ENGINES = {"reference": ("reference", {}), "compact": ("compact", {"page_size": PAGE}),
           "waiting": ("compact", {"page_size": PAGE, "max_decode_rows": 5})}
STOPS = tuple(range(0, 500, 12))  # ~1 in 12 ids: about half the rows stop early
#: (temperature, truncation) of the compared calls; the first two share compiled
#: functions, the truncated path compiles its own (slow)
CALLS = {"sampled": (1.0, None), "greedy": (0.0, None),
         "truncated": (0.9, rollout.Truncation(top_k=40, top_p=0.9))}
FAST = ("sampled", "greedy")


@pytest.fixture(scope="module")
def policy():
    model = random_model(get_config("tiny", dtype="float32", num_hidden_layers=1), seed=2)
    return state.ModelDef.of(model.cfg), state.params_of(model)


@pytest.fixture(scope="module")
def workload():
    """4 prompts of uneven lengths, G = 3 rows each, per-row budgets in [1, T]."""
    rng = np.random.default_rng(4)
    prompts = [rng.integers(20, 500, n).tolist() for n in (3, 17, 9, 30)]
    budgets = rng.integers(1, T + 1, len(prompts) * G)
    budgets[5] = T  # one row may run to the end
    return prompts, budgets


def _rollouts(policy, workload, names) -> dict:
    """``(engine, name) -> (Rollout, Work)`` of the ``CALLS`` named."""
    mdef, params = policy
    prompts, budgets = workload
    out = {}
    for engine, (impl, paging) in ENGINES.items():
        gen = rollout.Generator(mdef, max_new_tokens=T, stop_ids=STOPS, num_valid=500,
                                engine=impl, decode_chunk=CHUNK, rung_multiple=MULTIPLE,
                                rung_growth=GROWTH, **paging)
        for name in names:
            temperature, trunc = CALLS[name]
            ro = gen(params, prompts, jax.random.key(9), temperature=temperature,
                     truncation=trunc, group_size=G, max_new_tokens=budgets)
            out[engine, name] = ro, gen.last_work
    return out


@pytest.fixture(scope="module")
def rollouts(policy, workload):
    return _rollouts(policy, workload, FAST)


@pytest.fixture(scope="module")
def truncated(policy, workload):
    return _rollouts(policy, workload, ("truncated",))


@pytest.mark.parametrize("engine", ["compact", "waiting"])
@pytest.mark.parametrize("name", [*FAST, pytest.param("truncated", marks=pytest.mark.slow)])
def test_compact_draws_the_reference_tokens(request, workload, name, engine):
    rollouts = request.getfixturevalue("truncated" if name == "truncated" else "rollouts")
    (ref, _), (got, _) = rollouts["reference", name], rollouts[engine, name]
    differ = int(np.sum(ref.tokens != got.tokens))
    assert differ == 0, f"{differ} tokens differ"
    np.testing.assert_array_equal(got.lengths, ref.lengths)
    np.testing.assert_array_equal(got.stopped, ref.stopped)
    for field in ("logprobs", "logmass"):  # float rounding of other batch shapes only
        np.testing.assert_allclose(getattr(got, field), getattr(ref, field), atol=1e-5,
                                   rtol=0, err_msg=field)
    np.testing.assert_array_equal(got.min_logit == -np.inf, ref.min_logit == -np.inf)
    assert got.path == ref.path
    # the workload exercises what it should: budgets and stop tokens both end rows, the
    # rows of a group differ when sampled and agree when greedy
    _, budgets = workload
    assert np.all(ref.lengths <= budgets) and ref.stopped.any()
    assert np.any(~ref.stopped & (ref.lengths == budgets))
    first = ref.tokens[:, 0].reshape(-1, G)  # every row draws at least one token
    same = np.all(first == first[:, :1], axis=1)
    assert same.all() if name == "greedy" else not same.all()


def test_work_follows_the_completions(rollouts, workload):
    prompts, budgets = workload
    rows = len(prompts) * G
    for name in FAST:
        (ro, ref), (_, work) = rollouts["reference", name], rollouts["compact", name]
        # each distinct prompt prefilled once (the reference: once per row)
        assert work.prefill_tokens == sum(map(len, prompts))
        assert ref.prefill_tokens == G * work.prefill_tokens
        # decode: at each chunk start the active rows (length > step) in their rung, for
        # the steps until the chunk ends or every row is done; the chunks' lengths follow
        # ``next_chunk`` (halved after rows finished, doubled after none did)
        ladder = jaxhead.bucket_ladder(rows, multiple=MULTIPLE, growth=GROWTH)
        want, start, chunk, finished, sizes = 0, 1, 0, False, []
        while (ro.lengths > start).any():
            running = ro.lengths > start
            active = ro.lengths[running]
            chunk = next_chunk(chunk, finished, max(1, CHUNK // 16), CHUNK,
                               int(budgets[running].max()) - start)
            rung = next(r for r in ladder if r >= len(active))
            want += rung * min(chunk, active.max() - start)
            finished = bool((active <= start + chunk).any())
            sizes.append(chunk)
            start += chunk
        assert work.decode_row_steps == want, name
        assert len(set(sizes)) > 1, sizes  # the chunks did adapt
        # <= each row's decode steps plus less than a chunk, x the ladder's worst padding
        worst = max(next(r for r in ladder if r >= a) / a for a in range(1, rows + 1))
        steps = np.where(ro.lengths > 1, ro.lengths - 1 + CHUNK - 1, 0)
        assert work.decode_row_steps <= worst * steps.sum()
        assert ref.decode_row_steps == ladder[-1] * (ro.lengths.max() - 1)
        assert work.decode_row_steps < 0.8 * ref.decode_row_steps


def test_kv_cache_holds_what_the_rows_write(rollouts, workload):
    """The paged cache's peak is at most the prompts' full pages once per prompt plus,
    per row, its own pages of what it wrote and the next chunk's; the reference holds
    ``W + T`` slots for every row."""
    prompts, _ = workload
    lens = np.repeat([len(p) for p in prompts], G)
    for engine in ("compact", "waiting"):
        (ro, ref), (_, work) = rollouts["reference", "sampled"], rollouts[engine, "sampled"]
        shared = sum(len(p) // PAGE for p in prompts)
        written = lens + ro.lengths - 1 + CHUNK  # at most a chunk past the last write
        own = np.ceil(written / PAGE) - lens // PAGE
        assert 0 < work.kv_slots_held <= PAGE * (shared + own.sum()), engine
        # the pool is allocated in doublings from 8 pages
        assert work.kv_slots_held <= work.kv_slots < 2 * max(work.kv_slots_held, 8 * PAGE)
        assert ref.kv_slots == ref.kv_slots_held == len(lens) * (64 + T)  # prompts: 64 slots
        assert work.kv_slots < ref.kv_slots / 4, engine


def test_bad_arguments_raise(policy):
    mdef, params = policy
    with pytest.raises(ValueError, match="rollout.engine = 'paged': must be one of"):
        rollout.Generator(mdef, max_new_tokens=4, stop_ids=(), num_valid=500, engine="paged")
    with pytest.raises(ValueError, match="decode chunk must be an int >= 1, got 0"):
        rollout.Generator(mdef, max_new_tokens=4, stop_ids=(), num_valid=500, decode_chunk=0)
    with pytest.raises(ValueError, match="page_size must be an int >= 1, got 0"):
        rollout.Generator(mdef, max_new_tokens=4, stop_ids=(), num_valid=500, page_size=0)
    with pytest.raises(ValueError, match="max_rows must be an int >= 0, got -1"):
        rollout.Generator(mdef, max_new_tokens=4, stop_ids=(), num_valid=500,
                          max_decode_rows=-1)
    gen = rollout.Generator(mdef, max_new_tokens=4, stop_ids=(), num_valid=500)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"max_new_tokens must be ints in \[1, 4\]"):
        gen(params, [[1, 2]], key, temperature=1.0, group_size=2, max_new_tokens=[1, 5])
    with pytest.raises(ValueError, match=r"one per row: 2\), got \[1, 2, 3\]"):
        gen(params, [[1, 2]], key, temperature=1.0, group_size=2, max_new_tokens=[1, 2, 3])
    with pytest.raises(ValueError, match="group_size must be a positive int, got 0"):
        gen(params, [[1, 2]], key, temperature=1.0, group_size=0)


def test_short_long_tailed_completions_leave_the_batch_soon(policy):
    """Reported case (issue "Nothing silent", item 13): with decode chunks of a fixed 64
    steps a long-tailed batch of short completions (budgets ``ceil(128 u^3)``, mean ~32,
    stop tokens off) cost 0.63 of every row decoding to the end here; chunks sized from
    the rows still running (``next_chunk``) bring it to <= 0.40 (0.38; the ideal, the
    completions' own steps, is 0.28: the rest is the row ladder's rungs)."""
    mdef, params = policy
    rng = np.random.default_rng(1)
    longest, rows = 128, 64
    budgets = np.ceil(longest * rng.random(rows) ** 3).astype(np.int32)
    budgets[0] = longest
    prompts = [rng.integers(20, 500, int(n)).tolist() for n in rng.integers(5, 40, rows // 8)]
    gen = rollout.Generator(mdef, max_new_tokens=longest, stop_ids=(), num_valid=500,
                            page_size=16)  # the defaults: decode_chunk 64, ladder of 8s
    ro = gen(params, prompts, jax.random.key(0), temperature=1.0, group_size=8,
             max_new_tokens=budgets)
    np.testing.assert_array_equal(ro.lengths, budgets)
    everyone = rows * (longest - 1)  # every row decoding to the end
    ideal = (budgets - 1).sum() / everyone
    cost = gen.last_work.decode_row_steps / everyone
    assert ideal < 0.3 and cost <= 0.40, (ideal, cost)
