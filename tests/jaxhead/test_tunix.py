"""``jaxhead.integrations.tunix`` against Tunix itself, on tiny random float32 Qwen3 models.

Runs only where Tunix is installed (``pip install -e '.[tunix,test]'``). The oracle is the
installed Tunix: its ``compute_per_token_logps`` (full logits), ``compute_entropy_from_logits``,
GRPO / PPO losses and GRPO learner; the adapter must give the same numbers from the hidden
states (f32: <= 1e-5, the platform's matmul rounding being the only difference)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("tunix")

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.llama3 import model as llama3
from tunix.models.qwen3 import model as qwen3
from tunix.rl import algo_core, common, function_registry
from tunix.rl.grpo import grpo_learner
from tunix.rl.ppo import ppo_learner

from jaxhead.integrations import tunix as jaxhead_tunix
from tests.support import ROOT

V, PAD, EOS = 300, 0, 2


def _qwen3(tied: bool, vocab: int = V, seed: int = 0, scale: float | None = None):
    """1-layer Qwen3, f32, whose head is scaled (default) so that the next-token
    distributions look like a trained LM's: entropies ~0.3-5 nats, log-probs down to ~-30
    (random init alone gives near-uniform distributions, log-probs all near -log V).

    Not sharper: where a distribution is nearly one-hot (entropy < ~1e-2) Tunix's float32
    entropy gradient (autodiff through ``log_softmax`` of the full logits) loses digits to
    cancellation (~3e-3 relative at entropies ~1e-5, against float64), while jaxhead's stays
    at ~4e-6; the two then differ by Tunix's error, not by the adapter's."""
    cfg = qwen3.ModelConfig(
        num_layers=1, vocab_size=vocab, embed_dim=64, hidden_dim=128, num_heads=4,
        head_dim=16, num_kv_heads=2, rope_theta=10_000, norm_eps=1e-6,
        use_tied_embedding=tied,
    )
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))
    head = model.embedder.input_embedding if tied else model.lm_head.w
    head.set_value(head.get_value() * (scale or (15.0 if tied else 8.0)))
    return model


def _unpacked(seed=0, batch=4, prompt=5, completion=7):
    """Left-padded prompts, right-padded completions (as Tunix's GRPO learner builds them)."""
    rng = np.random.default_rng(seed)
    p = rng.integers(3, V, (batch, prompt))
    p[0, :2] = PAD
    c = rng.integers(3, V, (batch, completion))
    c[1, 4:] = PAD
    c[2, 6:] = PAD
    return jnp.asarray(p, jnp.int32), jnp.asarray(c, jnp.int32)


def _packed(seed=1):
    """One row: two (prompt, completion) segments and padding, as ``rl.utils.pack_sequences``."""
    rng = np.random.default_rng(seed)
    seg = np.array([[1] * 9 + [2] * 10 + [0] * 5], np.int32)
    pos = np.array([list(range(9)) + list(range(10)) + [0] * 5], np.int32)
    mask = np.array([[0] * 4 + [1] * 5 + [0] * 3 + [1] * 7 + [0] * 5], np.int32)
    tokens = rng.integers(3, V, seg.shape)
    tokens[seg == 0] = PAD
    return (jnp.asarray(tokens, jnp.int32), jnp.asarray(seg), jnp.asarray(pos),
            jnp.asarray(mask))


def _assert_masked_close(ours, theirs, mask, atol=1e-5):
    ours, theirs, mask = np.asarray(ours), np.asarray(theirs), np.asarray(mask, bool)
    assert ours.shape == theirs.shape == mask.shape
    err = np.abs(np.where(mask, ours - theirs, 0.0)).max()
    assert err <= atol, err
    assert not np.any(np.where(mask, 0.0, ours)), "positions outside the mask must be 0"


def _rel_err(ours, theirs):
    """Max over leaves of max|ours - theirs| / max|theirs|."""
    errs = jax.tree.leaves(jax.tree.map(
        lambda a, b: float(jnp.abs(a - b).max() / jnp.maximum(jnp.abs(b).max(), 1e-30)),
        ours, theirs))
    return max(errs)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_logps_and_entropy_equal_tunix(tied):
    model = _qwen3(tied)
    graphdef, state = nnx.split(model)
    prompt, completion = _unpacked()
    ref, logits = common.compute_per_token_logps(
        graphdef, state, prompt, completion, PAD, EOS, return_logits=True, temperature=0.7)
    ref_entropy = algo_core.compute_entropy_from_logits(logits)
    logps, entropy = jaxhead_tunix.compute_per_token_logps(
        graphdef, state, prompt, completion, PAD, EOS, temperature=0.7, return_entropy=True)
    mask = completion != PAD
    _assert_masked_close(logps, ref, mask)
    _assert_masked_close(entropy, ref_entropy, mask)
    # the distributions are far from uniform, so the comparison means something
    assert float(jnp.where(mask, ref_entropy, 0).max()) < 0.8 * np.log(V)
    assert float(jnp.where(mask, ref, 0).min()) < -10.0
    if tied:  # same default keep as Tunix (completion != pad), same layout without entropy
        only = jaxhead_tunix.compute_per_token_logps(graphdef, state, prompt, completion,
                                                     PAD, EOS, temperature=0.7)
        np.testing.assert_array_equal(only, logps)


def test_packed_logps_and_entropy_equal_tunix():
    model = _qwen3(tied=False)
    graphdef, state = nnx.split(model)
    tokens, seg, pos, mask = _packed()
    empty = jnp.zeros((1, 0), jnp.int32)
    ref, logits = common.compute_per_token_logps(
        graphdef, state, empty, tokens, PAD, EOS, return_logits=True, segment_ids=seg,
        segment_positions=pos)
    ref_entropy = algo_core.compute_entropy_from_logits(logits)
    logps, entropy = jaxhead_tunix.compute_per_token_logps(
        graphdef, state, empty, tokens, PAD, EOS, segment_ids=seg, segment_positions=pos,
        completion_mask=mask, return_entropy=True)
    _assert_masked_close(logps, ref, mask)
    _assert_masked_close(entropy, ref_entropy, mask)
    # without a completion mask: every token with a predecessor in its own segment
    every = jaxhead_tunix.compute_per_token_logps(
        graphdef, state, empty, tokens, PAD, EOS, segment_ids=seg, segment_positions=pos)
    inside = np.zeros(seg.shape, bool)
    inside[:, 1:] = (np.asarray(seg[:, 1:]) == np.asarray(seg[:, :-1])) & (
        np.asarray(seg[:, 1:]) != 0)
    _assert_masked_close(every, ref, inside)


def _grads_and_loss(loss_fn, model, example, algo_config):
    graphdef, state = nnx.split(model)

    def loss(state):
        return loss_fn(nnx.merge(graphdef, state), example, algo_config, PAD, EOS)

    (value, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return value, aux, grads


def _assert_same_loss(loss_tunix, loss_jaxhead, model, example, algo_config):
    value, aux, grads = _grads_and_loss(loss_tunix, model, example, algo_config)
    value_j, aux_j, grads_j = _grads_and_loss(loss_jaxhead, model, example, algo_config)
    assert abs(float(value_j - value)) <= 1e-5 * abs(float(value)), (value_j, value)
    assert set(aux_j) == set(aux)
    for key in aux:
        np.testing.assert_allclose(aux_j[key], aux[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert _rel_err(grads_j, grads) <= 1e-5, _rel_err(grads_j, grads)
    head = grads["embedder"]["input_embedding"] if "lm_head" not in grads else grads["lm_head"]["w"]
    assert float(jnp.abs(head[...]).max()) > 0  # the head's gradient is compared, not all 0
    return aux


def test_grpo_loss_and_gradients_equal_tunix():
    model = _qwen3(tied=False)
    prompt, completion = _unpacked(seed=2)
    rng = np.random.default_rng(3)
    shape = completion.shape
    current, _ = common.compute_per_token_logps(  # the call of the first test: compiled
        *nnx.split(model), prompt, completion, PAD, EOS, return_logits=True, temperature=0.7)
    example = common.TrainExample(
        prompt_ids=prompt, prompt_mask=prompt != PAD, completion_ids=completion,
        completion_mask=completion != PAD,
        advantages=jnp.asarray(rng.normal(size=shape[0]), jnp.float32),
        ref_per_token_logps=current + jnp.asarray(rng.normal(size=shape), jnp.float32),
        old_per_token_logps=current + 0.2 * jnp.asarray(rng.normal(size=shape), jnp.float32),
    )
    config = grpo_learner.GRPOConfig(num_generations=2, beta=0.04, epsilon=0.2)
    config.temperature = 0.7
    aux = _assert_same_loss(algo_core.grpo_loss_fn, jaxhead_tunix.grpo_loss_fn, model,
                            example, config)
    assert 0 < float(aux["pg_clipfrac"]) < 1  # both clipped and unclipped tokens


def test_ppo_loss_with_entropy_bonus_packed_equals_tunix():
    model = _qwen3(tied=True)
    tokens, seg, pos, mask = _packed(seed=4)
    rng = np.random.default_rng(5)
    current = common.compute_per_token_logps(
        *nnx.split(model), jnp.zeros((1, 0), jnp.int32), tokens, PAD, EOS, segment_ids=seg,
        segment_positions=pos)
    example = common.TrainExample(
        prompt_ids=jnp.zeros((1, 0), jnp.int32), prompt_mask=jnp.zeros((1, 0), jnp.int32),
        completion_ids=tokens, completion_mask=mask,
        advantages=jnp.asarray(rng.normal(size=tokens.shape), jnp.float32) * mask,
        ref_per_token_logps=None,
        old_per_token_logps=current + 0.2 * jnp.asarray(rng.normal(size=tokens.shape),
                                                        jnp.float32),
        segment_ids=seg, segment_positions=pos,
    )
    config = ppo_learner.PPOConfig(entropy_coef=0.05, epsilon_c=3.0)
    aux = _assert_same_loss(algo_core.ppo_policy_loss_fn, jaxhead_tunix.ppo_loss_fn, model,
                            example, config)
    assert 0 < float(aux["pg_clipfrac"]) < 1 and float(aux["loss/entropy"]) > 0.1


def test_policy_losses_switch_and_restore():
    tunix_grpo = function_registry.get_policy_loss_fn("grpo")
    tunix_ppo = function_registry.get_policy_loss_fn("ppo")
    with jaxhead_tunix.policy_losses():
        assert function_registry.get_policy_loss_fn("grpo") is jaxhead_tunix.grpo_loss_fn
        assert function_registry.get_policy_loss_fn("ppo") is jaxhead_tunix.ppo_loss_fn
        with jaxhead_tunix.policy_losses("grpo", impl="xla"):
            assert function_registry.get_policy_loss_fn("grpo").impl == "xla"
        assert function_registry.get_policy_loss_fn("grpo") is jaxhead_tunix.grpo_loss_fn
    assert function_registry.get_policy_loss_fn("grpo") is tunix_grpo
    assert function_registry.get_policy_loss_fn("ppo") is tunix_ppo
    with pytest.raises(RuntimeError), jaxhead_tunix.policy_losses():
        raise RuntimeError("restored on errors too")
    assert function_registry.get_policy_loss_fn("grpo") is tunix_grpo
    with pytest.raises(ValueError, match="dapo"), jaxhead_tunix.policy_losses(["dapo"]):
        pass


class _HiddenOnly(nnx.Module):
    """Gives hidden states (it has ``output_hidden_states``) but is not registered."""

    def __call__(self, tokens, positions, cache, attention_mask, output_hidden_states=False):
        raise AssertionError("never called: the head is looked up first")


def test_errors_name_the_model_and_the_problem():
    prompt, completion = _unpacked()
    cfg = llama3.ModelConfig(num_layers=1, vocab_size=V, embed_dim=32, hidden_dim=64,
                             num_heads=2, head_dim=16, num_kv_heads=1, rope_theta=10_000,
                             norm_eps=1e-6)
    graphdef, state = nnx.split(llama3.Llama3(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match=r"Llama3 \(tunix\.models\.llama3\.model\.Llama3\).*"
                                        r"no output_hidden_states.*register_model"):
        jaxhead_tunix.compute_per_token_logps(graphdef, state, prompt, completion, PAD, EOS)

    graphdef, state = nnx.split(_HiddenOnly())
    with pytest.raises(TypeError, match=r"_HiddenOnly .*head weight is unknown.*Qwen3"):
        jaxhead_tunix.compute_per_token_logps(graphdef, state, prompt, completion, PAD, EOS)

    graphdef, state = nnx.split(_qwen3(tied=False))
    with pytest.raises(ValueError, match="return_entropy=True"):
        jaxhead_tunix.compute_per_token_logps(graphdef, state, prompt, completion, PAD, EOS,
                                              return_logits=True)
    with pytest.raises(ValueError, match="needs a prompt column"):
        jaxhead_tunix.compute_per_token_logps(graphdef, state, prompt[:, :0], completion,
                                              PAD, EOS)

    lora = _qwen3(tied=False)
    lora.lm_head.w_lora_a = nnx.LoRAParam(jnp.zeros((64, 2)))
    graphdef, state = nnx.split(lora)
    with pytest.raises(NotImplementedError, match="LoRA"):
        jaxhead_tunix.compute_per_token_logps(graphdef, state, prompt, completion, PAD, EOS)


def _load(relative):
    """A script of the repository (``examples/``, ``benchmarks/``) as a module."""
    spec = importlib.util.spec_from_file_location(relative.stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _train_two_steps(example, use_jaxhead: bool, num_iterations: int, sampling: bool = False):
    """``examples/tunix_grpo.py``'s cluster, two GRPO updates, with or without the
    drop-in (``sampling``: its draw too); ``num_iterations = 2``: both on the first batch
    (old-policy log-probs)."""
    cluster = example.cluster(max_steps=2)
    completions, prompts = [], []
    cluster.with_external_metrics_logger(
        lambda buffer: completions.extend(buffer.metrics["completions"][0]
                                          if "completions" in buffer.metrics else []))
    generate = cluster.generate

    def recorded(*args, **kwargs):
        out = generate(*args, **kwargs)
        prompts.append((list(kwargs["prompts"]), [
            example.CharTokenizer().decode(row) for row in out.left_padded_prompt_tokens]))
        return out

    cluster.generate = recorded
    config = grpo_learner.GRPOConfig(num_generations=2, num_iterations=num_iterations,
                                     beta=0.04)
    with (jaxhead_tunix.drop_in(sampling=sampling) if use_jaxhead
          else contextlib.nullcontext()):
        learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=config,
                                           reward_fns=example.reward)
        learner.train(example.PROMPTS)
    logger = cluster.actor_trainer.metrics_logger
    metrics = {name: logger.get_metric_history("actor", name, "train")
               for name in ("loss", "grad_norm", "kl", "pg_clipfrac", "perplexity")}
    return metrics, completions, prompts, nnx.state(cluster.actor_trainer.model, nnx.Param)


@pytest.mark.parametrize("num_iterations", [1, 2])
def test_grpo_learner_two_steps_same_metrics_as_tunix(monkeypatch, num_iterations):
    """Policy loss, reference log-probs and (``num_iterations = 2``) old-policy log-probs
    through jaxhead, Tunix's draw kept (``drop_in(sampling=False)``): the learner's metrics
    and parameters after two updates are Tunix's; the sampler saw B x G prompts, each the
    given text."""
    calls = []
    for name in ("policy_logps", "compute_per_token_logps"):
        inner = getattr(jaxhead_tunix.logps, name)
        monkeypatch.setattr(jaxhead_tunix.logps, name, functools.partial(
            lambda inner, name, *a, **k: calls.append(name) or inner(*a, **k), inner, name))
    example = _load(Path("examples") / "tunix_grpo.py")
    metrics, completions, prompts, params = _train_two_steps(example, False, num_iterations)
    assert not calls
    metrics_j, completions_j, prompts_j, params_j = _train_two_steps(example, True,
                                                                     num_iterations)
    # the loss traced (once: both updates run its compiled step), and the reference (and
    # old-policy) log-probs once per batch, besides the loss's own call
    batches = 2 // num_iterations
    losses = calls.count("policy_logps")
    assert losses >= 1, calls
    assert calls.count("compute_per_token_logps") - losses == batches * (
        1 + (num_iterations > 1)), calls
    assert completions_j == completions and len(completions) == batches, completions
    assert all(text for step in completions for text in step), completions
    texts = [t for t in example.TEXTS for _ in range(2)]  # B x G rows, G = 2
    assert prompts_j == prompts == [(texts, texts)] * batches, prompts
    for name, values in metrics.items():
        assert values.shape == (2,), (name, values)
        np.testing.assert_allclose(metrics_j[name], values, rtol=1e-5, atol=1e-7,
                                   err_msg=name)
    assert float(metrics["grad_norm"].min()) > 0
    assert _rel_err(params_j, params) <= 1e-5


def test_grpo_learner_trains_with_the_whole_drop_in(monkeypatch):
    """``drop_in()`` as users enter it, the rollouts drawn by jaxhead too: two updates on
    the example's cluster, every rollout token drawn through ``sample_from_logits``, the
    sampler fed B x G rows of the given texts, completions and metrics of a working run
    (another random stream than Tunix's, so not Tunix's numbers)."""
    from jaxhead.integrations.tunix import sampler

    draws = []
    inner = sampler.sample_from_logits
    monkeypatch.setattr(sampler, "sample_from_logits",
                        lambda *a, **k: draws.append(a[0].shape) or inner(*a, **k))
    example = _load(Path("examples") / "tunix_grpo.py")
    metrics, completions, prompts, params = _train_two_steps(example, True, 1, sampling=True)
    assert draws, "the rollouts were not drawn by jaxhead"
    texts = [t for t in example.TEXTS for _ in range(2)]
    assert prompts == [(texts, texts)] * 2, prompts
    assert len(completions) == 2 and all(text for step in completions for text in step)
    for name, values in metrics.items():
        assert values.shape == (2,) and np.all(np.isfinite(values)), (name, values)
    assert float(metrics["grad_norm"].min()) > 0
    start = nnx.state(example.tiny_qwen3(), nnx.Param)
    assert _rel_err(params, start) > 0  # it trained


def test_compiled_temporaries_at_most_a_twentieth_of_tunix():
    """``benchmarks/tunix_memory.py`` on a smaller shape than docs/integrations.md's (H = 4096,
    V = 151936, 16,384 tokens: the same ratio holds there, 1/23 f32, 1/26 bf16)."""
    benchmark = _load(Path("benchmarks") / "tunix_memory.py")
    m = benchmark.measure(hidden=256, vocab=65536, batch=4, prompt=32, completion=1024,
                          dtype="float32")
    logits_bytes = 4 * 1024 * 65536 * 4
    assert m["tunix"] > 2 * logits_bytes, m  # Tunix holds several [B, T, V] f32 copies
    assert m["jaxhead"] * 20 <= m["tunix"], m
