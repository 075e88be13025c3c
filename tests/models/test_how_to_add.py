"""docs/layout.md's "How to add ...", done as the list says: a head kernel is one more entry
of ``jaxhead._src.head.api.REGISTRY`` and ``token_logprobs(impl=...)`` runs it; an attention
kernel is one more entry of ``models.attention.api.REGISTRY`` and a model whose
``attention_impl`` names it builds and runs; an MoE dispatch path is one more entry of
``models.moe.api.REGISTRY``: the config check takes ``expert_dispatch`` naming it, and the
expert-parallel experts (``routed_experts``, under a mesh) run through it; a KV-cache kind
is a cache and a layer view of the one interface (``models.cache``), which the decoder
runs without knowing it. Each trivial entry wraps an
existing path, so its results are that path's bit for bit. (A rollout engine:
``test_engine_registry.py``; a model family: ``test_hf_families.py``; a loss variant:
``tests/train/test_how_to_add_loss.py``.)"""

from __future__ import annotations

from typing import NamedTuple

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
from models.cache import KVCache, LayerKV
from models.config import get_config
from models.mesh import make_mesh
from models.moe import api as moe_api
from tests.support.models import random_model, random_tokens


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


def test_an_moe_dispatch_path_added_to_the_registry_runs(monkeypatch):
    dense = moe_api.REGISTRY["dense"]
    calls = []

    def mine(plan, *args, **kwargs):
        calls.append(args[0].shape)
        return dense.call(plan, *args, **kwargs)

    registry = _with(moe_api.REGISTRY, dispatch.Entry("mine", mine, auto=False))
    monkeypatch.setattr(moe_api, "REGISTRY", registry)
    monkeypatch.setattr(transformer, "EXPERT_DISPATCH", registry)  # check_ops' name for it
    transformer.check_ops(get_config("tiny-moe", expert_dispatch="mine"))  # the config takes it
    with pytest.raises(ValueError, match="'theirs'"):
        transformer.check_ops(get_config("tiny-moe", expert_dispatch="theirs"))
    rng = np.random.default_rng(4)
    tokens, h, i, e, k = 24, 16, 8, 4, 2
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.float32)
    weights, experts = jax.lax.top_k(
        jax.nn.softmax(jnp.asarray(rng.standard_normal((tokens, e)), jnp.float32)), k)
    params = [jnp.asarray(rng.standard_normal(shape) / 4, jnp.float32)
              for shape in ((e, h, i), (e, h, i), (e, i, h))]
    mesh = make_mesh()  # the dispatch paths are the expert-parallel ones: under a mesh
    out = {}
    with jax.set_mesh(mesh):
        for name in ("mine", "dense"):
            out[name] = jax.jit(lambda name=name: moe_api.routed_experts(
                x, experts, weights, *params, mesh=mesh, dispatch=name)[0])()
    assert calls, "the new dispatch path was not called"
    np.testing.assert_array_equal(out["mine"], out["dense"])


class CountingLayerKV(NamedTuple):
    """A trivial new kind's layer view: the dense view, counting its attends."""

    inner: LayerKV
    log: list

    def write(self, keys, values):
        return self.inner.write(keys, values)

    def attend(self, q, k, v, attention, positions, segment_ids):
        self.log.append("attend")
        return self.inner.attend(q, k, v, attention, positions, segment_ids)


class CountingKVCache(NamedTuple):
    """A trivial new cache kind: the dense cache behind the interface's three calls."""

    inner: KVCache
    log: list

    def begin(self, positions, segment_ids):
        inner, overflow = self.inner.begin(positions, segment_ids)
        return self._replace(inner=inner), overflow

    def layer(self, i):
        return CountingLayerKV(self.inner.layer(i), self.log)

    def end(self, keys, values, num_new):
        return self._replace(inner=self.inner.end(keys, values, num_new))


def test_a_cache_kind_runs_in_the_decoder_unchanged():
    model = random_model(get_config("tiny", dtype="float32"), seed=4)
    prompt = jnp.asarray(random_tokens((2, 5), seed=5))
    step = jnp.asarray(random_tokens((2, 1), seed=6))
    ones = jnp.ones((2, 5), jnp.int32)

    def decode(cache, unwrap):
        out = model(prompt, jnp.broadcast_to(jnp.arange(5), (2, 5)), ones, cache)
        first = out.hidden
        out = model(step, jnp.full((2, 1), 5), ones[:, :1], out.cache)
        return first, out.hidden, unwrap(out.cache)

    log = []
    mine = decode(CountingKVCache(model.init_cache(2, 8), log), lambda c: c.inner)
    dense = decode(model.init_cache(2, 8), lambda c: c)
    assert log == ["attend"] * (2 * model.cfg.num_hidden_layers)
    np.testing.assert_array_equal(mine[0], dense[0])
    np.testing.assert_array_equal(mine[1], dense[1])
    for a, b in zip(jax.tree.leaves(mine[2]), jax.tree.leaves(dense[2]), strict=True):
        np.testing.assert_array_equal(a, b)
