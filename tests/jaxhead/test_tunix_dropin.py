"""``jaxhead.integrations.tunix.drop_in`` against Tunix itself: the trainers' call forms,
an LM head with a bias, the hidden-state capture, and the reference / old-policy /
anchor log-probs of ``RLCluster`` with and without the drop-in (tiny float32 models).

Runs only where Tunix is installed (``pip install -e '.[tunix,test]'``)."""

from __future__ import annotations

import inspect
import warnings

import numpy as np
import pytest

pytest.importorskip("tunix")

from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.rl import algo_core, common, function_registry
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner
from tunix.tests import test_common

from jaxhead.integrations import tunix as jaxhead_tunix
from jaxhead.integrations.tunix import heads, logps
from jaxhead.integrations.tunix.testing import register_test_models
from tests.jaxhead.test_tunix import (
    EOS,
    PAD,
    V,
    _assert_masked_close,
    _load,
    _qwen3,
    _rel_err,
    _unpacked,
)

register_test_models()


def _toy(seed: int = 0):
    """Tunix's test model: ``lm_head = nnx.Linear(16, V)`` with a bias, made non-zero
    (its init is zeros) so that the bias matters to every log-prob."""
    model = test_common.ToyTransformer(test_common.ModelConfig(num_layers=1, vocab_size=V),
                                       rngs=nnx.Rngs(seed))
    bias = model.lm_head.bias
    bias.set_value(jax.random.normal(jax.random.key(seed + 1), bias.get_value().shape))
    return model


def _example(model, ppo: bool, seed: int = 2):
    """A ``TrainExample`` with reference and old-policy log-probs near the model's own."""
    prompt, completion = _unpacked(seed=seed)
    rng = np.random.default_rng(seed + 1)
    shape = completion.shape
    current = common.compute_per_token_logps(*nnx.split(model), prompt, completion, PAD, EOS)
    noise = lambda s: jnp.asarray(s * rng.normal(size=shape), jnp.float32)
    adv = rng.normal(size=shape if ppo else shape[0])
    return common.TrainExample(
        prompt_ids=prompt, prompt_mask=prompt != PAD, completion_ids=completion,
        completion_mask=completion != PAD, advantages=jnp.asarray(adv, jnp.float32),
        ref_per_token_logps=current + noise(0.5), old_per_token_logps=current + noise(0.2))


def _configs():
    grpo = grpo_learner.GRPOConfig(num_generations=2, beta=0.04, epsilon=0.2,
                                   kl_loss_mode="low_var_kl")
    grpo.temperature = 0.7
    return {"grpo": grpo, "ppo": ppo_learner.PPOConfig(entropy_coef=0.05, epsilon_c=3.0)}


@pytest.mark.parametrize(("name", "impl"), [("grpo", "auto"), ("ppo", "auto"), ("ppo", "xla")])
def test_registered_losses_take_every_call_form_of_tunix(name, impl):
    """Tunix's PPO trainer calls the registered loss as ``nnx.value_and_grad(loss_fn)(model,
    **inputs)`` inside ``nnx.jit`` (``PeftTrainer._train_step``); nnx binds the keywords to
    positions and refused the jaxhead losses' keyword-only ``impl`` (TypeError)."""
    tunix_loss = function_registry.get_policy_loss_fn(name)
    with jaxhead_tunix.policy_losses(impl=impl):
        ours = function_registry.get_policy_loss_fn(name)
    assert inspect.signature(ours) == inspect.signature(tunix_loss)
    model = _qwen3(tied=name == "ppo")
    inputs = {"train_example": _example(model, ppo=name == "ppo"),
              "algo_config": _configs()[name], "pad_id": PAD, "eos_id": EOS}

    def train_step(loss_fn):
        return nnx.jit(lambda m: nnx.value_and_grad(loss_fn, has_aux=True)(m, **inputs))(model)

    (loss, _), grads = train_step(ours)
    (loss_t, _), grads_t = train_step(tunix_loss)
    assert abs(float(loss - loss_t)) <= 1e-5 * abs(float(loss_t)), (loss, loss_t)
    assert _rel_err(grads, grads_t) <= 1e-5
    # the GRPO learners' form: positional model and example, keywords for the rest
    out, _ = jax.jit(lambda m: ours(m, inputs["train_example"], algo_config=inputs[
        "algo_config"], pad_id=PAD, eos_id=EOS))(model)
    np.testing.assert_allclose(out, loss, rtol=1e-5)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_head_bias_gets_tunix_gradient(name):
    """``ToyTransformer``'s head has a bias: folded into jaxhead's matmul, its gradient is
    Tunix's (it was exactly 0 before), and the loss and every other gradient too."""
    model = _toy()
    example = _example(model, ppo=name == "ppo")
    config = _configs()[name]
    tunix_loss = {"grpo": algo_core.grpo_loss_fn, "ppo": algo_core.ppo_policy_loss_fn}[name]
    ours = {"grpo": jaxhead_tunix.grpo_loss_fn, "ppo": jaxhead_tunix.ppo_loss_fn}[name]
    (loss_t, aux_t), grads_t = nnx.value_and_grad(tunix_loss, has_aux=True)(
        model, example, config, PAD, EOS)
    (loss, aux), grads = nnx.value_and_grad(ours, has_aux=True)(model, example, config, PAD,
                                                                 EOS)
    assert abs(float(loss - loss_t)) <= 1e-5 * abs(float(loss_t)), (loss, loss_t)
    for key in aux_t:
        np.testing.assert_allclose(aux[key], aux_t[key], rtol=1e-5, atol=1e-6, err_msg=key)
    bias_t, bias = grads_t["lm_head"]["bias"][...], grads["lm_head"]["bias"][...]
    assert float(jnp.abs(bias_t).max()) > 1e-3
    np.testing.assert_allclose(bias, bias_t, rtol=1e-5, atol=1e-5 * float(jnp.abs(bias_t).max()))
    assert _rel_err(grads, grads_t) <= 1e-5


class _Unbiased(test_common.ToyTransformer):
    """Registered as if its head had no bias: the adapter must refuse it."""


def test_unread_head_parameter_is_refused():
    heads.register_model(_Unbiased, lambda m: heads.TunixHead(
        module=m.lm_head, weight=m.lm_head.kernel[...], dtype=jnp.float32))
    model = _Unbiased(test_common.ModelConfig(num_layers=1, vocab_size=V), rngs=nnx.Rngs(0))
    prompt, completion = _unpacked()
    with pytest.raises(NotImplementedError, match=r"_Unbiased.*bias \(Param \[300\]\).*"
                                                  r"reads 1.*no gradient"):
        jaxhead_tunix.compute_per_token_logps(*nnx.split(model), prompt, completion, PAD, EOS)


def test_hidden_states_captured_without_deprecated_sow():
    """``Module.sow()`` outside ``nnx.capture()`` warns (Flax 0.12.8, deprecated)."""
    model = _qwen3(tied=True)
    prompt, completion = _unpacked(prompt=6)  # a shape no other test traced
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*sow.*capture", category=DeprecationWarning)
        out = jaxhead_tunix.compute_per_token_logps(*nnx.split(model), prompt, completion, PAD,
                                                    EOS)
        tokens = jnp.concatenate([prompt, completion], axis=1)
        hidden, _ = heads.final_hidden(model, tokens, {
            "positions": jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape),
            "cache": None, "attention_mask": jnp.tril(jnp.ones((1,) + tokens.shape[1:] * 2,
                                                               bool))})
    assert out.shape == completion.shape and hidden.shape == tokens.shape + (64,)
    assert not jax.tree.leaves(nnx.state(model, nnx.Intermediate))  # nothing left behind


def _cluster_logps(cluster, prompt, completion):
    """Reference, old-policy (rollout) and anchor-policy log-probs of ``RLCluster``."""
    cluster.sync_weights()  # sets the anchor policy state
    return {"reference": cluster.get_ref_per_token_logps(prompt, completion, PAD, EOS),
            "old policy": cluster.get_old_per_token_logps(prompt, completion),
            "anchor": cluster.get_actor_per_token_logps(prompt, completion, PAD, EOS)}


def test_reference_and_old_policy_logps_equal_tunix(monkeypatch):
    cluster = _load(Path("examples") / "tunix_grpo.py").cluster()
    prompt, completion = _unpacked(seed=4)
    prompt, completion = prompt % 40, completion % 40  # the example's 41-token vocabulary
    completion = jnp.where(completion < 3, PAD, completion)
    theirs = _cluster_logps(cluster, prompt, completion)
    calls = []
    inner = logps.compute_per_token_logps

    def spy(*args, **kwargs):
        calls.append(args[11])  # the temperature
        return inner(*args, **kwargs)

    monkeypatch.setattr(logps, "compute_per_token_logps", spy)
    with jaxhead_tunix.log_probs():
        ours = _cluster_logps(cluster, prompt, completion)
    assert len(calls) == 3, calls  # each path went through jaxhead
    assert not hasattr(common.compute_per_token_logps, "original")  # restored
    mask = completion != PAD
    for key in theirs:
        _assert_masked_close(ours[key], theirs[key], mask)
    assert calls[0] == cluster.cluster_config.rollout_config.temperature  # the reference T



class _LogitsOnly(nnx.Module):
    """A model the adapter cannot read, as the mock models of Tunix's agentic learner
    tests: logits only, no hidden states, not registered."""

    def __init__(self):
        self.bias = nnx.Param(jax.random.normal(jax.random.key(0), (V,)))

    def __call__(self, inputs, positions, cache, attention_mask, **kwargs):
        del positions, cache, attention_mask, kwargs
        return jnp.broadcast_to(self.bias[...], (*inputs.shape, V)), None


def test_a_model_the_adapter_cannot_read_is_left_to_tunix():
    """Issue 36: ``drop_in()`` raised ``TypeError`` on such a model (4 of Tunix's agentic
    learner tests failed). Now that computation is Tunix's, with one warning naming the
    model and ``register_model``; ``strict=True`` raises."""
    model = _LogitsOnly()
    example = _example(model, ppo=False)
    config = _configs()["grpo"]
    args = (model, example, config, PAD, EOS)
    prompt, completion = _unpacked(seed=2)
    want_loss, want_aux = algo_core.grpo_loss_fn(*args)
    want_logps = common.compute_per_token_logps(*nnx.split(model), prompt, completion, PAD, EOS)
    with warnings.catch_warnings(record=True) as caught, jaxhead_tunix.drop_in():
        warnings.simplefilter("always")
        loss, aux = function_registry.get_policy_loss_fn("grpo")(*args)
        got_logps = common.compute_per_token_logps(*nnx.split(model), prompt, completion,
                                                   PAD, EOS)
    np.testing.assert_array_equal(loss, want_loss)
    np.testing.assert_array_equal(aux["kl"], want_aux["kl"])
    np.testing.assert_array_equal(got_logps, want_logps)
    ours = [w for w in caught if "drop-in" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert "_LogitsOnly" in str(ours[0].message) and "register_model" in str(ours[0].message)
    with jaxhead_tunix.drop_in(strict=True), pytest.raises(
            TypeError, match=r"_LogitsOnly .*register_model"):
        function_registry.get_policy_loss_fn("grpo")(*args)
    with pytest.raises(TypeError, match=r"_LogitsOnly .*register_model"):  # outside a block
        jaxhead_tunix.grpo_loss_fn(*args)
