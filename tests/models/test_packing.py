"""Packed rows: sequences packed in one row score exactly as when run alone."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxhead
from models import get_config
from tests.support.models import causal_inputs, random_model, random_tokens


@nnx.jit
def scores(model, tokens, positions, segment_ids):
    """jaxhead log-probs and entropy of every next token within its segment."""
    labels, valid = jaxhead.next_token_labels(tokens, segment_ids)
    head, _ = model.token_logprobs(tokens, positions, segment_ids, labels, valid,
                                   bucket=tokens.size)  # every position fits: no warning
    return head.logprobs, head.entropy


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_packed_sequences_match_each_run_alone(preset):
    model = random_model(get_config(preset, dtype="float32"), seed=2)
    a, b = random_tokens((1, 7), seed=10), random_tokens((1, 5), seed=11)
    pad = np.full((1, 4), 3, np.int32)
    # row 0: [a, b, pad]; row 1: [b, a, pad]
    tokens = jnp.asarray(np.concatenate([np.concatenate([a, b, pad], 1),
                                         np.concatenate([b, a, pad], 1)]))
    seg = jnp.asarray([[1] * 7 + [2] * 5 + [0] * 4, [1] * 5 + [2] * 7 + [0] * 4])
    pos = jnp.asarray([list(range(7)) + list(range(5)) + [0] * 4,
                       list(range(5)) + list(range(7)) + [0] * 4])
    packed_logp, packed_ent = scores(model, tokens, pos, seg)
    # a alone (no padding) and b alone (padding after it) in one batch
    alone_tokens = np.concatenate([a, np.concatenate([b, pad[:, :2]], 1)])
    alone_seg = jnp.asarray([[1] * 7, [1] * 5 + [0] * 2])
    alone_logp, alone_ent = scores(model, *causal_inputs(alone_tokens)[:2], alone_seg)
    alone = {"a": (alone_logp[0], alone_ent[0]), "b": (alone_logp[1, :5], alone_ent[1, :5])}
    spans = [(0, "a", 0, 7), (0, "b", 7, 12), (1, "b", 0, 5), (1, "a", 5, 12)]
    for row, name, start, stop in spans:
        np.testing.assert_allclose(packed_logp[row, start:stop], alone[name][0], rtol=0,
                                   atol=1e-5, err_msg=f"row {row} seq {name}")
        np.testing.assert_allclose(packed_ent[row, start:stop], alone[name][1], rtol=0,
                                   atol=1e-5, err_msg=f"row {row} seq {name}")
    assert np.all(np.asarray(packed_logp)[:, 12:] == 0)  # padding is never scored
    assert np.all(np.asarray(alone["a"][0])[:-1] != 0)  # real next tokens are scored
    # the padding's token ids are read by nothing
    repadded = tokens.at[:, 12:].set(tokens[:, 12:] + 100)
    np.testing.assert_array_equal(scores(model, repadded, pos, seg)[0], packed_logp)
