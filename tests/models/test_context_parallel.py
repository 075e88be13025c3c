"""Context parallelism (``models.context``, ``models.attention.context``): a ``context``
mesh axis splits each row's tokens. The trainer's GRPO step (dense tied model on
context=4 x fsdp=2, the MoE on context=4 x expert=2) on packed rows with padding gives the
loss, log-probs, entropy and every parameter gradient of one device; rollouts under it
decode what one device does; the load-balanced order and the token-major layout are exact
permutations; the index-masked kernels are refused under it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxhead.dispatch import KernelUnsupported
from models import context
from models.attention.api import self_attention
from models.transformer import from_head_rows, head_bucket, head_rows
from tests.support.multidevice import abstract_mesh, run_case

#: Relative error bound, float32 (measured: loss 7.6e-8, log-probs 1.2e-7, gradients
#: <= 3.1e-6 dense, 2.2e-6 MoE).
TOL = 1e-5


def test_balance_order_gives_each_device_an_early_and_a_late_chunk():
    order = context.balance_order(16, 2)
    # 4 chunks of 4: device 0 holds chunks 0 and 3, device 1 chunks 1 and 2
    assert order.tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11]
    for c in (1, 2, 4, 8):
        assert sorted(context.balance_order(64, c).tolist()) == list(range(64))
    with pytest.raises(ValueError, match=r"row of 12 tokens .* 8 chunks of context=4"):
        context.balance_order(12, 4)


def test_layouts_round_trip():
    x = np.random.default_rng(0).standard_normal((3, 16, 5)).astype(np.float32)
    for c in (1, 2, 4):
        np.testing.assert_array_equal(context.unbalance(context.balance(x, c), c), x)
        major = context.to_token_major(x, c)
        assert major.shape == (3 * c, 16 // c, 5)
        # row c * B + b holds row b's c-th shard of tokens
        np.testing.assert_array_equal(major[(c - 1) * 3 + 2], x[2, (c - 1) * 16 // c:])
        np.testing.assert_array_equal(context.from_token_major(major, c), x)


def test_the_heads_bucket_reads_the_rows_as_the_head_gets_them():
    """``head_bucket`` (what the trainer's bucket asks for) counts each token shard's kept
    tokens in the load-balanced, token-major rows of ``head_rows``: a keep mask on the
    first and last chunk of each row puts every kept token on context device 0, which a
    contiguous split of the row would miss (2 per shard, not 4: the head would then
    overflow into NaN)."""
    mesh = abstract_mesh(context=2, data=2)
    keep = np.zeros((2, 8), bool)
    keep[:, [0, 1, 6, 7]] = True  # chunks 0 and 3 of 4: both on device 0
    rows = np.asarray(head_rows(keep, mesh))
    assert rows.shape == (4, 4) and rows.sum(axis=1).tolist() == [4, 4, 0, 0]
    assert head_bucket(keep, mesh, multiple=1) == 4 > keep.reshape(4, 4).sum(axis=1).max()
    x = np.arange(16).reshape(2, 8)
    np.testing.assert_array_equal(from_head_rows(head_rows(x, mesh), mesh), x)
    assert head_bucket(keep, abstract_mesh(data=2), multiple=1) == 4  # rows only


def test_kernels_masking_by_index_are_refused_under_context():
    q = jax.ShapeDtypeStruct((2, 16, 4, 8), jnp.float32)
    kv = jax.ShapeDtypeStruct((2, 16, 2, 8), jnp.float32)
    ids = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    refused = pytest.raises(KernelUnsupported, match="splash masks causally by token index")
    with jax.sharding.use_abstract_mesh(abstract_mesh(context=4)), refused:
        jax.eval_shape(lambda *a: self_attention(*a, scale=0.3, impl="splash"),
                       q, kv, kv, ids, ids)


@pytest.fixture(scope="module")
def measured() -> dict:
    return run_case("tests.models.context_cases:all_cases", timeout=1200)


def _check(result: dict, mesh: str, layers: int) -> None:
    got = result[mesh]
    assert result["kept"] > 0 and result["padding_rows"] == 2
    assert result["context_attention_calls"] >= layers, result
    assert got["loss"] <= TOL and got["logp"] <= TOL and got["entropy"] <= TOL, got
    worst = max(got["grads"], key=got["grads"].get)
    assert got["grads"][worst] <= TOL, (worst, got["grads"][worst])


def test_dense_step_on_context_parallel_mesh_equals_one_device(measured):
    _check(measured["dense"], "context4_fsdp2", 2)


def test_moe_step_on_context_parallel_mesh_equals_one_device(measured):
    _check(measured["moe"], "context4_expert2", 2)


def test_rollouts_under_a_context_mesh_match_one_device(measured):
    mesh, one = measured["decode"]["mesh"], measured["decode"]["one_device"]
    for name in ("greedy", "sampled"):
        for key in ("tokens", "lengths", "stopped"):
            assert mesh[name][key] == one[name][key], (name, key)
        np.testing.assert_allclose(mesh[name]["logprobs"], one[name]["logprobs"], rtol=0,
                                   atol=1e-5, err_msg=name)
