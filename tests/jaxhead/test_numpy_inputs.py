"""Every public function of ``jaxhead`` that takes arrays accepts numpy arrays as it does
jax arrays, with the same results (the reported case: numpy labels with a keep mask raised
``AttributeError: 'numpy.ndarray' object has no attribute 'at'``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType

import jaxhead

N, H, V = 24, 16, 96


def _inputs():
    rng = np.random.default_rng(0)
    return {"hidden": rng.standard_normal((N, H)).astype(np.float32),
            "weight": (0.3 * rng.standard_normal((H, V))).astype(np.float32),
            "labels": rng.integers(0, V, N).astype(np.int32),
            "keep": rng.random(N) < 0.6,
            "temperature": rng.uniform(0.5, 1.5, N).astype(np.float32),
            "segment_ids": np.repeat(np.array([[1, 1, 2, 0]], np.int32), 6, axis=1),
            "loss_mask": (rng.random((1, N)) < 0.7).astype(np.float32)}


def _mesh():
    return jax.make_mesh((1,), ("data",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:1])


CALLS = {
    "token_logprobs": lambda a: jaxhead.token_logprobs(
        a["hidden"], a["weight"], a["labels"], a["keep"], temperature=a["temperature"],
        bucket=24),
    "reference_token_logprobs": lambda a: jaxhead.reference_token_logprobs(
        a["hidden"], a["weight"], a["labels"], a["keep"], temperature=a["temperature"]),
    "sharded_token_logprobs": lambda a: jaxhead.sharded_token_logprobs(
        a["hidden"], a["weight"], a["labels"], a["keep"], mesh=_mesh(), token_axes=("data",),
        bucket=24, temperature=a["temperature"]),
    "sample": lambda a: jaxhead.sample(a["hidden"], a["weight"], jax.random.key(0),
                                       temperature=0.8, top_k=8),
    "keep_mask": lambda a: jaxhead.keep_mask(loss_mask=a["loss_mask"],
                                             segment_ids=a["segment_ids"],
                                             aligned_to="predictions"),
    "next_token_labels": lambda a: jaxhead.next_token_labels(
        a["labels"][None], segment_ids=a["segment_ids"]),
    "shift_to_predictions": lambda a: jaxhead.shift_to_predictions(
        a["loss_mask"], segment_ids=a["segment_ids"]),
    "bucket_for_shards": lambda a: jaxhead.bucket_for_shards(a["keep"].reshape(2, -1), 2),
    "LMHead": lambda a: _head(a),
}


def _head(a):
    head = jaxhead.LMHead(H, V, rngs=nnx.Rngs(0))
    head.kernel[...] = jnp.asarray(a["weight"])
    return head(a["hidden"], a["labels"], a["keep"], bucket=24)


@pytest.mark.parametrize("name", sorted(CALLS))
def test_numpy_and_jax_arrays_give_the_same_result(name):
    a = _inputs()
    as_numpy = CALLS[name](a)
    as_jax = CALLS[name]({k: jnp.asarray(v) for k, v in a.items()})
    for x, y in zip(jax.tree.leaves(as_numpy), jax.tree.leaves(as_jax), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any(np.asarray(x).size > 1 and np.asarray(x).std() > 0
               for x in jax.tree.leaves(as_jax)) or name == "bucket_for_shards"
