"""Requests are independent in both rollout engines (``train.rl.rollout.Generator`` over
``models.generate``):

* **keyed by request**: a request's noise depends on the key, its request id and its
  sample index, never on the row it runs in. The reported case: ``gen([X])`` and
  ``gen(others[:7] + [X] + others[7:])`` drew 19 of 20 different tokens for X; with the
  same request id X now draws the same tokens alone, moved, under continuous batching and
  in the other engine.
* **isolated**: a request whose KV holds a NaN (its prompt reaches a NaN embedding row)
  leaves every other request's tokens and log-probs bit-identical to the same call
  without the NaN. The reported case: in the ``compact`` engine the paged attention
  multiplied masked-out weights (0) by whatever the pages held (0 x NaN = NaN), unused
  block-table entries pointed at page 0 (another request's) and freed pages were reused
  unwiped, so the other requests' decode log-probs turned NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import get_config
from tests.support.models import random_model
from train.rl import rollout, state

T, G, PAGE = 10, 2, 4
STOPS = tuple(range(0, 500, 16))
#: engine -> ``Generator`` arguments: the paged engine also with few places (rows wait,
#: freed pages are reused by later rows)
ENGINES = {"reference": {"engine": "reference"},
           "compact": {"engine": "compact", "page_size": PAGE},
           "waiting": {"engine": "compact", "page_size": PAGE, "max_decode_rows": 3}}
#: the token whose embedding row is NaN (the other prompts draw from [20, 500))
BAD = 7


@pytest.fixture(scope="module", params=["dense", "moe"])
def policy(request):
    """An untied tiny model (a NaN embedding row must not reach the head's weight)."""
    cfg = (get_config("tiny", dtype="float32", tie_word_embeddings=False)
           if request.param == "dense" else get_config("tiny-moe", dtype="float32"))
    model = random_model(cfg, seed=3)
    return state.ModelDef.of(model.cfg), state.params_of(model)


_GENERATORS: dict = {}


def _generator(mdef, engine: str) -> rollout.Generator:
    """One generator (its compiled functions) per model and engine for the module."""
    if (mdef, engine) not in _GENERATORS:
        _GENERATORS[mdef, engine] = rollout.Generator(
            mdef, max_new_tokens=T, stop_ids=STOPS, num_valid=500, decode_chunk=3,
            rung_multiple=4, rung_growth=1.5, **ENGINES[engine])
    return _GENERATORS[mdef, engine]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(20, 500, int(k)).tolist() for k in rng.integers(2, 14, n)]


# the MoE model in the slow set: request keys are the engine's, whatever the model (the
# dense model runs by default; the NaN tests below run both)
@pytest.mark.parametrize("policy", ["dense", pytest.param("moe", marks=pytest.mark.slow)],
                         indirect=True)
def test_moved_request_draws_the_same_tokens(policy):
    """X alone (request id 42) and X at place 7 of 10 prompts (the same id) draw the
    same tokens, in every engine; and X as the default request 7 (its index) draws
    what X alone under request id 7 draws (on the reference engine: the engines agree on
    a request's draw, checked below)."""
    mdef, params = policy
    others, (x,) = _prompts(9, 0), _prompts(1, 1)
    moved = others[:7] + [x] + others[7:]
    ids = [*range(7), 42, *range(7, 9)]
    key = jax.random.key(5)
    runs = {}
    for engine in ENGINES:
        gen = _generator(mdef, engine)
        alone = gen(params, [x], key, temperature=1.0, group_size=G, request_ids=[42])
        among = gen(params, moved, key, temperature=1.0, group_size=G, request_ids=ids)
        np.testing.assert_array_equal(among.tokens[7 * G:8 * G], alone.tokens)
        np.testing.assert_array_equal(among.lengths[7 * G:8 * G], alone.lengths)
        np.testing.assert_allclose(among.logprobs[7 * G:8 * G], alone.logprobs, atol=1e-5)
        runs[engine] = alone.tokens
    gen = _generator(mdef, "reference")
    default = gen(params, moved, key, temperature=1.0, group_size=G)
    as_7 = gen(params, [x], key, temperature=1.0, group_size=G, request_ids=[7])
    np.testing.assert_array_equal(default.tokens[7 * G:8 * G], as_7.tokens)
    for engine in ENGINES:  # the engines agree on the request's draw
        np.testing.assert_array_equal(runs[engine], runs["reference"])
    # not a vacuous pass: the sample index and the request id each change the draw
    assert not np.array_equal(runs["reference"][0], runs["reference"][1])
    assert not np.array_equal(runs["reference"], as_7.tokens)


def test_bad_request_ids_are_refused(policy):
    gen = _generator(policy[0], "reference")
    for ids, match in (([1, 1], "distinct"), ([0], "one per prompt"),
                       ([-1, 2], r"\[0, 2\*\*31\)"), ([0.5, 1.0], "ints")):
        with pytest.raises(ValueError, match=match):
            gen(policy[1], [[30, 31], [40]], jax.random.key(0), temperature=1.0,
                request_ids=ids)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_nan_request_leaves_the_others_bit_identical(policy, engine):
    """Prompt 2 reaches the NaN embedding row (and stops early, so its pages are freed
    and reused); every other request's tokens, log-probs and lengths equal, bit for
    bit, those of the same call where prompt 2 avoids the NaN row."""
    mdef, params = policy
    poisoned = dict(params)
    poisoned["embed_tokens.embedding"] = params["embed_tokens.embedding"].at[BAD].set(
        jnp.nan)
    prompts = _prompts(6, 2)
    prompts[2] = prompts[2][:3] + [BAD] + prompts[2][3:]
    clean = [p[:] for p in prompts]
    clean[2][3] = 21
    budgets = np.full(len(prompts) * G, T)
    budgets[2 * G:3 * G] = 2
    gen = _generator(mdef, engine)
    others = np.r_[0:2 * G, 3 * G:len(budgets)]
    for temperature in (1.0, 0.0):
        bad, ok = (gen(poisoned, p, jax.random.key(8), temperature=temperature,
                       group_size=G, max_new_tokens=budgets) for p in (prompts, clean))
        assert np.isnan(bad.logprobs[2 * G]).any()  # the NaN reached its own request
        for field in ("tokens", "logprobs", "min_logit", "logmass", "lengths", "stopped"):
            np.testing.assert_array_equal(getattr(bad, field)[others],
                                          getattr(ok, field)[others],
                                          err_msg=f"{field} at T={temperature}")
        assert np.isfinite(bad.logprobs[others]).all()
