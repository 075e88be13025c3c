"""``jaxhead.integrations.tunix.sampling``: Tunix's vanilla sampler drawing with
``jaxhead.sample_from_logits`` follows the softmax of the logits Tunix's model computed
(untruncated and truncated) as Tunix's own draw does, returns Tunix's log-probs, and is
restored on exit.

Runs only where Tunix is installed (``pip install -e '.[tunix,test]'``)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("tunix")

import jax.numpy as jnp
from tunix.generate import sampler as tunix_sampler

from jaxhead.integrations import tunix as jaxhead_tunix
from jaxhead.integrations.tunix import sampler
from tests.jaxhead.test_tunix import EOS, PAD, _qwen3
from tests.support.sampling import chi_square_ok

ROWS = 4000  # one prompt, repeated: ROWS draws of its first completion token


class _IdTokenizer:
    """Space-separated ids (pad 0, eos 2, no BOS)."""

    def encode(self, text, **kwargs):
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self):
        return None

    def eos_id(self):
        return EOS

    def pad_id(self):
        return PAD


PROMPT = [17, 240, 5, 99, 31, 8, 150, 3]  # as long as max_prompt_length: no padding


def _model():
    return _qwen3(tied=False, seed=3, scale=4.0)


def _first_tokens(temperature, **truncation):
    """ROWS draws of the first completion token of ``PROMPT`` by a fresh Tunix sampler
    (compiled where it is called) and their log-probs."""
    cache = tunix_sampler.CacheConfig(cache_size=16, num_layers=1, num_kv_heads=2, head_dim=16)
    draw = tunix_sampler.Sampler(_model(), _IdTokenizer(), cache)
    out = draw([" ".join(map(str, PROMPT))] * ROWS, max_generation_steps=1,
               max_prompt_length=len(PROMPT), temperature=temperature, seed=5,
               return_logprobs=True, eos_tokens=[10**6], **truncation)  # keep every draw
    return np.array([row[0] for row in out.tokens]), np.array([row[0] for row in out.logprobs])


def _prompt_logits():
    """float64 logits of the token after ``PROMPT`` (Tunix's model, no cache)."""
    t = len(PROMPT)
    logits, _ = _model()(jnp.asarray([PROMPT]), jnp.arange(t)[None], None,
                         jnp.tril(jnp.ones((1, t, t), bool)))
    return np.asarray(logits[0, -1], np.float64)


def _tempered_log_softmax(logits, temperature):
    l = logits / temperature
    return l - l.max() - np.log(np.exp(l - l.max()).sum())


@pytest.mark.parametrize("truncation", [{"top_p": 1.0}, {"top_p": 0.8, "top_k": 20}], ids=str)
def test_the_draw_follows_the_softmax_of_tunix_logits(truncation, monkeypatch):
    calls = []
    inner = sampler.sample_from_logits
    monkeypatch.setattr(sampler, "sample_from_logits",
                        lambda *a, **k: calls.append(k) or inner(*a, **k))
    temperature = 0.8
    with jaxhead_tunix.sampling():
        tokens, logprobs = _first_tokens(temperature, **truncation)
    assert calls, "the sampler did not draw through jaxhead"
    assert not hasattr(tunix_sampler.sample_top_p, "original")  # restored
    logp = _tempered_log_softmax(_prompt_logits(), temperature)
    p = np.exp(logp)
    if "top_k" in truncation:  # Tunix's order: the top k, then the nucleus inside them
        order = np.argsort(-p, kind="stable")[: truncation["top_k"]]
        q = p[order] / p[order].sum()
        keep = order[: np.searchsorted(np.cumsum(q), truncation["top_p"]) + 1]
        p = np.zeros_like(p)
        p[keep] = np.exp(logp[keep])
        p /= p.sum()
        assert set(np.unique(tokens)) <= set(keep.tolist())
    assert len(np.unique(tokens)) > 5, np.unique(tokens)  # not a degenerate row
    chi_square_ok(np.bincount(tokens, minlength=p.size), p, str(truncation))
    # Tunix's log-prob: under the whole tempered softmax, truncated or not
    np.testing.assert_allclose(logprobs, logp[tokens], atol=1e-5)


def test_every_top_p_tunix_accepts():
    """Tunix takes any float ``top_p``: 0 keeps its most likely id, above 1 is untruncated;
    inside the block both draw (``sample_from_logits`` refuses such values itself)."""
    with jaxhead_tunix.sampling():
        top, _ = _first_tokens(0.8, top_p=0.0)
        wide, _ = _first_tokens(0.8, top_p=1.5)
    np.testing.assert_array_equal(top, np.argmax(_prompt_logits()))
    assert len(np.unique(wide)) > 5


def test_restored_on_exit_errors_included():
    tunix_draw = tunix_sampler.sample_top_p
    with pytest.raises(RuntimeError), jaxhead_tunix.sampling():
        assert tunix_sampler.sample_top_p.original is tunix_draw
        with jaxhead_tunix.sampling():  # nests
            pass
        assert tunix_sampler.sample_top_p.original is tunix_draw
        raise RuntimeError
    assert tunix_sampler.sample_top_p is tunix_draw
    with jaxhead_tunix.drop_in(sampling=False):
        assert tunix_sampler.sample_top_p is tunix_draw
    with jaxhead_tunix.drop_in():
        assert tunix_sampler.sample_top_p.original is tunix_draw
    assert tunix_sampler.sample_top_p is tunix_draw


def test_tunix_draw_and_jaxhead_draw_agree_in_distribution():
    """Both draws of the same logits: Tunix's ``jax.random.categorical`` (outside the
    block) and jaxhead's, each against the float64 softmax, and the two log-prob rules
    equal on the tokens each drew."""
    temperature = 1.1
    theirs, theirs_logp = _first_tokens(temperature, top_p=1.0)
    with jaxhead_tunix.sampling():
        ours, ours_logp = _first_tokens(temperature, top_p=1.0)
    logp = _tempered_log_softmax(_prompt_logits(), temperature)
    for tokens, lp, who in ((theirs, theirs_logp, "tunix"), (ours, ours_logp, "jaxhead")):
        chi_square_ok(np.bincount(tokens, minlength=logp.size), np.exp(logp), who)
        np.testing.assert_allclose(lp, logp[tokens], atol=1e-5, err_msg=who)
    assert not np.array_equal(ours, theirs)  # another random stream
