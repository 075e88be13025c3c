"""Tunix's own tests with jaxhead's drop-in active: copy this file into the ``tests/``
folder of a Tunix source checkout at the installed version's tag and run pytest there.

    git clone https://github.com/google/tunix && cd tunix && git checkout v0.1.7
    cp "$(python -c 'import jaxhead.integrations.tunix.testing as t, os;
           print(os.path.dirname(t.__file__))')/conftest.py" tests/conftest.py
    JAX_PLATFORMS=cpu python -m pytest -p no:cacheprovider tests/rl/grpo tests/rl/ppo

Every test runs inside ``jaxhead.integrations.tunix.drop_in()`` (the policy losses, the
reference / old-policy / anchor log-probs and the vanilla sampler's draw on jaxhead), with Tunix's test model
``ToyTransformer`` registered (``register_test_models``); a test in which Tunix's
full-logits ``compute_per_token_logps`` still ran for a registered model (a head
computation the drop-in missed, or a test calling Tunix's own loss directly) errors at
teardown. Models the adapter cannot read (e.g. the tests' mock models without hidden
states) are left to Tunix by the drop-in, with one warning each. The environment variable
``JAXHEAD_TUNIX_DROP_IN=0`` turns all of it off (the same run on Tunix's own code).
"""

from __future__ import annotations

import os

import pytest
from flax import nnx
from tunix.rl import common

from jaxhead.integrations import tunix as jaxhead_tunix
from jaxhead.integrations.tunix.heads import registered
from jaxhead.integrations.tunix.testing import register_test_models

ACTIVE = os.environ.get("JAXHEAD_TUNIX_DROP_IN", "1") != "0"

if ACTIVE:
    register_test_models()


@pytest.fixture(autouse=True)
def _jaxhead_drop_in(monkeypatch):
    """The test inside ``drop_in()``; fails it if Tunix's full-logits
    ``compute_per_token_logps`` ran anyway for a registered model (a head computation the
    drop-in missed)."""
    if not ACTIVE:
        yield
        return
    full_logits = []
    tunix_logps = common.compute_per_token_logps

    def counted(graphdef, state, *args, **kwargs):
        if registered(nnx.merge(graphdef, state)):
            full_logits.append(1)
        return tunix_logps(graphdef, state, *args, **kwargs)

    monkeypatch.setattr(common, "compute_per_token_logps", counted)
    with jaxhead_tunix.drop_in():
        yield
    assert not full_logits, (
        f"Tunix's full-logits compute_per_token_logps ran {len(full_logits)} times for a "
        "registered model with the drop-in active")
