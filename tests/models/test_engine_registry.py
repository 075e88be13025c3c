"""The rollout engines' one shape (docs/layout.md, "How to add a rollout engine"): an
engine listed in ``models.generate.ENGINES`` runs under the trainer's ``Generator``
without the generator knowing which it is, and ``IMPLEMENTATIONS`` (``rollout.engine``'s
domain) are the registry's names, derived from it."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from models import generate
from models.config import get_config
from tests.support.models import random_model
from train.rl import rollout, state


class CountingEngine(generate.ReferenceEngine):
    """A trivial new engine: the reference one, counting its calls."""

    calls = 0

    def __call__(self, *args, **kwargs):
        type(self).calls += 1
        return super().__call__(*args, **kwargs)


def test_the_names_are_the_registrys():
    assert generate.IMPLEMENTATIONS == tuple(generate.ENGINES)


def test_a_registered_engine_runs_under_the_generator(monkeypatch):
    model = random_model(get_config("tiny", dtype="float32"), seed=0)
    mdef, params = state.ModelDef.of(model.cfg), state.params_of(model)
    prompts = [[5, 6, 7], [8, 9]]

    def draw():
        gen = rollout.Generator(mdef, max_new_tokens=4, stop_ids=(), num_valid=300,
                                engine="reference")
        return gen, gen(params, prompts, jax.random.key(0), temperature=1.0, group_size=2)

    _, plain = draw()
    monkeypatch.setitem(generate.ENGINES, "reference", CountingEngine)
    gen, counted = draw()
    assert CountingEngine.calls == 1 and isinstance(gen.engine_for(False), CountingEngine)
    np.testing.assert_array_equal(counted.tokens, plain.tokens)
    assert gen.last_work.prefill_tokens == 2 * (3 + 2)  # its Work reached the generator


def test_the_compact_engine_refuses_to_lower_a_whole_call():
    model = random_model(get_config("tiny", dtype="float32"), seed=0)
    gen = rollout.Generator(state.ModelDef.of(model.cfg), max_new_tokens=4, stop_ids=(),
                            num_valid=300, engine="compact")
    with pytest.raises(ValueError, match="runs several programs a call"):
        gen.lower(state.params_of(model), [[5, 6, 7]], jax.random.key(0), temperature=1.0)
