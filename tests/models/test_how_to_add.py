"""docs/layout.md's "How to add ...", done through the registries: a head kernel is one more
entry of ``jaxhead._src.head.api.REGISTRY`` and ``token_logprobs(impl=...)`` runs it; an
attention kernel is one more entry of ``models.attention.api.REGISTRY`` and a model whose
``attention_impl`` names it builds and runs. Each trivial entry wraps an existing path, so
its results are that path's bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxhead
from jaxhead import dispatch
from jaxhead._src.head import api as head_api
from jaxhead._src.head import reference as head_reference
from models import transformer
from models.attention import api as attention_api
from models.config import get_config
from tests.support.models import random_model


def _with(registry: dispatch.Registry, entry: dispatch.Entry) -> dispatch.Registry:
    """``registry`` with ``entry`` appended (what adding its line to the list does)."""
    return dispatch.Registry(registry.op, [*(registry[n] for n in registry.names), entry])


def test_a_head_kernel_added_to_the_registry_runs_by_name(monkeypatch):
    entry = head_api.head_entry("mine", head_reference.REFERENCE, auto=False)
    monkeypatch.setattr(head_api, "REGISTRY", _with(head_api.REGISTRY, entry))
    k1, k2 = jax.random.split(jax.random.key(0))
    hidden = jax.random.normal(k1, (6, 8), jnp.float32)
    weight = jax.random.normal(k2, (8, 50), jnp.float32)
    labels = jnp.array([3, 7, 49, 0, 12, 3])
    mine = jaxhead.token_logprobs(hidden, weight, labels, impl="mine")
    ref = jaxhead.token_logprobs(hidden, weight, labels, impl="reference")
    np.testing.assert_array_equal(mine.logprobs, ref.logprobs)
    np.testing.assert_array_equal(mine.entropy, ref.entropy)
    with pytest.raises(ValueError, match="'theirs'"):  # the name is the registry's
        jaxhead.token_logprobs(hidden, weight, labels, impl="theirs")


def test_an_attention_kernel_added_to_the_registry_runs_in_a_model(monkeypatch):
    dense = attention_api.REGISTRY["dense"]
    calls = []

    def mine(plan, *args):
        calls.append(args[0].shape)
        return dense.call(plan, *args)

    registry = _with(attention_api.REGISTRY, dispatch.Entry("mine", mine, auto=False))
    monkeypatch.setattr(attention_api, "REGISTRY", registry)
    monkeypatch.setattr(transformer, "ATTENTION", registry)  # check_ops' name for it
    tokens = jnp.array([[5, 9, 13, 2, 7, 11]])
    positions = jnp.arange(6)[None]
    segments = jnp.ones((1, 6), jnp.int32)
    out = {}
    for impl in ("mine", "dense"):
        model = random_model(get_config("tiny", dtype="float32", attention_impl=impl), seed=0)
        out[impl] = model(tokens, positions, segments).hidden
    assert calls, "the new kernel was not called"
    np.testing.assert_array_equal(out["mine"], out["dense"])
