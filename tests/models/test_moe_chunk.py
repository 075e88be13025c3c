"""``ModelConfig.moe_token_chunk``: the MoE's experts take a device's tokens in sequential,
rematerialised chunks. Float32, the random tiny MoE on a packed batch with padding:
chunked equals unchunked (outputs and every gradient to 1e-5 relative, the aux loss, the
dropped fraction and the router statistics) on one device and on fsdp=2 x expert=4 with
the dense and the ragged dispatch (8 CPU devices, a subprocess), chunk sizes that divide
the tokens and ones that pad them; and the compiled temporaries of one MoE layer's
forward and backward stay nearly flat in the token count with chunks, where they grow
with it without."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import check_ops, get_config
from tests.models.moe_chunk_cases import layer_temp_bytes, one_device
from tests.support.models import random_model
from tests.support.multidevice import run_case

TOL = 1e-5


def _assert_equal(r):
    assert r["hidden"] <= TOL and r["grads"] <= TOL, r
    assert r["aux"] <= 1e-6 and r["dropped"] == 0, r
    assert r["aux_value"] > 0, r


def test_moe_token_chunk_is_validated():
    assert get_config("tiny-moe").moe_token_chunk is None
    assert get_config("tiny-moe", moe_token_chunk=64).moe_token_chunk == 64
    for bad in (0, -4, 1.5, True, "64"):
        with pytest.raises(ValueError, match=f"moe_token_chunk.*{bad!r}"):
            check_ops(get_config("tiny-moe", moe_token_chunk=bad))


@pytest.mark.parametrize("chunk", [32, 48])  # 128 tokens: 4 chunks; 3 with 16 padded
def test_one_device_chunks_equal_unchunked(chunk):
    _assert_equal(one_device(chunk))


def test_router_statistics_are_the_unchunked_ones():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 40, 64)), jnp.float32)
    mask = jnp.asarray(rng.random((2, 40)) < 0.8)
    outs = []
    for chunk in (None, 24):  # 80 tokens: 4 chunks, the last padded
        moe = random_model(get_config("tiny-moe", dtype="float32", moe_token_chunk=chunk),
                           seed=2).layers[0].mlp
        outs.append(jax.jit(lambda x, m, moe=moe: moe(x, m))(x, mask))
    (y0, s0), (y1, s1) = outs
    for a, b in zip(s1, s0, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.abs(np.asarray(y1 - y0)).max() <= TOL * np.abs(np.asarray(y0)).max()
    assert not np.asarray(y1)[~np.asarray(mask)].any()  # padding: output 0


# in the slow set: expert parallelism is test_expert_parallel.py's, chunking the one-device
# tests' above; this case is their product (an 8-device process)
@pytest.mark.slow
def test_expert_parallel_chunks_equal_unchunked():
    r = run_case("tests.models.moe_chunk_cases:mesh_case")
    for dispatch in ("dense", "ragged"):
        res = r[dispatch]
        for chunk in ("4", "6"):
            _assert_equal({**res[chunk], "aux_value": res["aux_value"]})


def test_chunks_bound_the_layer_temporaries():
    tokens, chunk = 512, 128
    plain = [layer_temp_bytes(t, None) for t in (tokens, 4 * tokens)]
    chunked = [layer_temp_bytes(t, chunk) for t in (tokens, 4 * tokens)]
    # measured: unchunked 9.03 MB -> 35.6 MB (x3.94), chunked 2.75 MB -> 3.35 MB (x1.21)
    assert plain[1] / plain[0] > 3, plain
    assert chunked[1] / chunked[0] < 1.5, chunked
    assert chunked[1] < plain[0], (plain, chunked)  # 4x the tokens, less than unchunked
