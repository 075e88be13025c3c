"""The head under a mesh. On 8 CPU devices (data=2 x expert=4, in a subprocess): token-split
with per-shard compaction, and vocab-parallel, against ``jaxhead.token_logprobs`` on one
device: log-probs, entropy and both gradients. In this process: errors (an abstract mesh
stands in for 8 devices), the host bucket choice, and the vocab-parallel combination of
statistics (``jax.vmap`` with an axis name stands in for the vocab axis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

import jaxhead
from harness.oracle import head_inputs
from jaxhead._src.head import xla
from jaxhead._src.head.base import HeadSpec
from jaxhead._src.head.scan import Tuning
from tests.jaxhead.sharding_cases import HEAD_CONFIGS
from tests.support.multidevice import run_case

MESH = AbstractMesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
TOKENS = ("data", "expert")

TOL = 1e-5


def test_sharded_head_matches_single_device():
    results = run_case("tests.jaxhead.sharding_cases:head_case")
    assert set(results) == set(HEAD_CONFIGS)
    for name, r in results.items():
        for key in ("logprobs", "entropy", "dhidden", "dweight", "dhidden_rel", "dweight_rel"):
            assert r[key] <= TOL, f"{name}: max |{key} - single device| = {r[key]:.3g} > {TOL}"
        # every shard compacted into one bucket smaller than its token count
        assert r["bucket"] < r["tokens_per_shard"], (name, r)
    # split like the labels [B, S] (a default mesh's Explicit axes type every dimension)
    assert results["tokens"]["out_spec"] == "P(('data', 'expert'), None)"
    assert results["vocab_parallel"]["out_spec"] == "P('data', None)"


def test_sharded_head_on_every_mesh_axis_type():
    """Issue 36: on ``jax.make_mesh``'s default mesh (Explicit axes) the head raised
    ``shard_map``'s in_specs error, eagerly and under ``jit``."""
    results = run_case("tests.jaxhead.sharding_cases:mesh_types_case")
    assert len(results) == 6
    for way, err in results.items():
        assert isinstance(err, float) and err <= TOL, f"{way}: {err}"


def head_args(batch=8, seq=4, hidden=32, vocab=256):
    """Host arrays: the checks run before anything is traced or compiled."""
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, seq, hidden), np.float32),
            rng.standard_normal((hidden, vocab), np.float32),
            rng.integers(0, vocab, (batch, seq)).astype(np.int32))


def test_batch_not_divisible_by_the_token_shards():
    with pytest.raises(ValueError, match=r"6 rows is not divisible by the 8 shards"):
        jaxhead.sharded_token_logprobs(*head_args(batch=6), mesh=MESH, token_axes=TOKENS)
    with pytest.raises(ValueError, match=r"6 rows is not divisible by the 4 shards"):
        jaxhead.sharded_token_logprobs(*head_args(batch=6), mesh=MESH, token_axes=("expert",))


def test_vocab_not_divisible_by_the_vocab_axis():
    with pytest.raises(ValueError, match=r"vocab size 250 is not divisible by the 4 devices"):
        jaxhead.sharded_token_logprobs(*head_args(vocab=250), mesh=MESH, token_axes=("data",),
                                       vocab_axis="expert")


def test_head_axis_and_bucket_errors():
    args = head_args()
    with pytest.raises(ValueError, match="also a token axis"):
        jaxhead.sharded_token_logprobs(*args, mesh=MESH, token_axes=TOKENS, vocab_axis="expert")
    with pytest.raises(ValueError, match=r"\['model'\] are not in the mesh"):
        jaxhead.sharded_token_logprobs(*args, mesh=MESH, token_axes=("model",))
    with jaxhead.pallas_interpret(), pytest.raises(jaxhead.KernelUnsupported,
                                                    match="no vocab-parallel variant"):
        jaxhead.sharded_token_logprobs(*args, mesh=MESH, token_axes=("data",),
                                       vocab_axis="expert", impl="pallas_tpu")
    keep = np.zeros((8, 4), bool)
    keep[3] = True  # shard 3 (of 8) keeps all of its 4 tokens
    with pytest.raises(ValueError, match=r"bucket=3 is smaller than the 4 kept tokens"):
        jaxhead.sharded_token_logprobs(*args, keep, mesh=MESH, token_axes=TOKENS, bucket=3)
    with pytest.raises(ValueError, match="no mesh"):
        jaxhead.sharded_token_logprobs(*args, token_axes=TOKENS)


def test_bucket_for_shards_on_the_host():
    keep = np.zeros((8, 100), bool)
    keep[5, :70] = True  # shard 2 of 4 (rows 4-5) holds 70 of its 200 tokens
    keep[0, :10] = True
    assert jaxhead.bucket_for_shards(keep, 4) == jaxhead.bucket_size(70, 200) == 128
    assert jaxhead.bucket_for_shards(keep, 8, multiple=16) == 80  # shard 5: 70 of 100
    with pytest.raises(ValueError, match="keep has 8 rows, not divisible into 3 token shards"):
        jaxhead.bucket_for_shards(keep, 3)


def test_vocab_parallel_combination_equals_one_pass():
    """Statistics of 4 vocab shards combined with pmax/psum equal one scan of the whole
    vocabulary: log-probs, entropy and logZ. Rows 0-3 have their max logit tied across
    two shards; rows 8-15 are scaled up so that some are peaked to entropies ~1e-6."""
    n, h, v, shards = 16, 32, 512, 4
    hidden, weight, labels = head_inputs(3, n, h, v, exact_dot=True)
    u = hidden[0]  # rows 0-3: the max logit ~12 at columns 5 and 389 (shards 0 and 3)
    col = jnp.round(12.0 * u / jnp.sum(u * u) * 1024) / 1024
    hidden = hidden.at[:4].set(u).at[8:].multiply(6.0)
    weight = weight.at[:, 5].set(col).at[:, 389].set(col)
    labels = labels.at[:2].set(389)
    temperature = jnp.full((n,), 0.9)
    w_shards = weight.reshape(h, shards, v // shards).transpose(1, 0, 2)
    config = jaxhead.XlaConfig(token_chunk=8, vocab_chunk=48)
    spec = HeadSpec(n, h, v, "float32", None, True, vocab_axis="v", vocab_shards=shards)
    plan, _ = xla.make_plan(config, spec, Tuning())
    full, _ = xla.make_plan(config, HeadSpec(n, h, v, "float32", None, True), Tuning())

    def log_z(rows):  # logZ = m / temperature + log s
        return rows.logp, rows.entropy, rows.m / temperature + rows.log_s

    untruncated = jnp.full((n,), -jnp.inf)
    per_shard = jax.vmap(
        lambda w: log_z(xla._forward(plan, hidden, w, labels, temperature, untruncated)),
        axis_name="v")
    got = jax.jit(per_shard)(w_shards)
    ref = jax.jit(lambda w: log_z(xla._forward(full, hidden, w, labels, temperature,
                                               untruncated)))(weight)
    for g, want in zip(got, ref, strict=True):
        for k in range(shards):  # every shard returns the combined values
            np.testing.assert_allclose(g[k], want, rtol=2e-6, atol=2e-6)
    z = hidden[:4] @ weight
    assert bool(jnp.all(jnp.argmax(z, axis=1) == 5)) and bool(jnp.all(z[:, 5] == z[:, 389]))
    assert float(jnp.min(jnp.abs(ref[1][8:]))) < 1e-5  # near-zero entropies are exercised
