"""Attention implementations against the dense reference: packed rows, padding, GQA,
forward and gradients, the KV-cache paths, the impl switch, and memory linear in length."""

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxhead.dispatch import KernelUnsupported
from models.attention import api as attention_api
from models.attention.api import cache_attention, self_attention
from models.attention.base import check_packing
from models.attention.reference import dense_attention
from models.attention.xla import chunked_attention
from models.config import ModelConfig, get_config
from models.transformer import DecoderLayer, check_ops
from tests.support.multidevice import run_case

RTOL = 1e-5


def packed(lengths_per_row, t):
    """Positions and segment ids ``[B, T]``: segments 1, 2, ... of the given lengths, then
    padding (segment 0, positions 0, 1, ...)."""
    pos, seg = np.zeros((2, len(lengths_per_row), t), np.int32)
    for row, lengths in enumerate(lengths_per_row):
        start = 0
        for i, n in enumerate(lengths):
            seg[row, start:start + n], pos[row, start:start + n] = i + 1, np.arange(n)
            start += n
        pos[row, start:] = np.arange(t - start)
    return jnp.asarray(pos), jnp.asarray(seg)


def qkv(key, b, t, s, n, k, d, dtype=jnp.float32):
    kq, kk, kv, kw = jax.random.split(key, 4)
    return (jax.random.normal(kq, (b, t, n, d), dtype), jax.random.normal(kk, (b, s, k, d), dtype),
            jax.random.normal(kv, (b, s, k, d), dtype), jax.random.normal(kw, (b, t, n, d)))


def rel(a, b):
    return float(jnp.abs(a - b).max() / jnp.abs(b).max())


def assert_matches(fn, ref, q, k, v, weight, real):
    """Forward on real (non-padding) queries, and gradients of ``sum(out * weight)`` with
    ``weight`` zero on padding queries, within ``RTOL`` of the reference."""
    mask = real[:, :, None, None]

    def run(f):
        def loss(*args):
            out = f(*args)
            return (out * weight * mask).sum(), out

        return jax.jit(jax.grad(loss, (0, 1, 2), has_aux=True))(q, k, v)

    (grads, out), (expect_grads, expect) = run(fn), run(ref)
    assert rel(out * mask, expect * mask) <= RTOL
    for name, g, e in zip("qkv", grads, expect_grads):
        assert rel(g, e) <= RTOL, name
    return out


@pytest.mark.parametrize("blocks", [(8, 16), (16, 8)])
def test_chunked_matches_dense(blocks):
    """Ragged tiles (40 tokens padded to 48), rows of 3 segments + padding and 3 full."""
    t = 40
    pos, seg = packed([[10, 15, 10], [3, 30, 7]], t)
    q, k, v, w = qkv(jax.random.key(blocks[0]), 2, t, t, 4, 2, 8)
    args = (pos, seg, pos, seg)
    fn = lambda q, k, v: chunked_attention(q, k, v, *args, scale=8 ** -0.5, block_q=blocks[0],
                                           block_kv=blocks[1])
    ref = lambda q, k, v: dense_attention(q, k, v, *args, scale=8 ** -0.5)
    out = assert_matches(fn, ref, q, k, v, w, seg != 0)
    # padding queries read nothing: exactly zero out
    assert float(jnp.abs(jnp.where((seg == 0)[:, :, None, None], out, 0)).max()) == 0


@pytest.mark.parametrize("blocks", [(8, 16), (16, 8)])
def test_nan_key_stays_nan_and_padding_is_zero(blocks):
    """A NaN key of one segment makes exactly the queries that read it NaN in the dense and
    the blockwise path (never 0); padding queries, which read nothing, are 0 in both; every
    other query matches the dense reference."""
    t = 40
    pos, seg = packed([[10, 15, 10], [3, 30, 7]], t)
    q, k, v, _ = qkv(jax.random.key(3), 2, t, t, 4, 2, 8)
    k = k.at[0, 14].set(jnp.nan)  # row 0, segment 2 (tokens 10..24), position 4
    args = (pos, seg, pos, seg)
    dense = dense_attention(q, k, v, *args, scale=8 ** -0.5)
    chunked = chunked_attention(q, k, v, *args, scale=8 ** -0.5, block_q=blocks[0],
                                block_kv=blocks[1])
    reads_nan = np.zeros((2, t), bool)
    reads_nan[0, 14:25] = True
    pad = np.asarray(seg == 0)
    for out in (chunked, dense):  # blockwise first: the reported NaN-to-0 case
        nan = np.isnan(np.asarray(out)).any(axis=(2, 3))
        np.testing.assert_array_equal(nan, reads_nan)
        assert np.isnan(np.asarray(out)[reads_nan]).all()
        assert np.all(np.asarray(out)[pad] == 0)
    fine = ~reads_nan & ~pad
    assert rel(chunked[fine], dense[fine]) <= RTOL


@pytest.mark.parametrize("impl", ["splash", "pallas_gpu"])
def test_kernel_matches_dense_interpreted(impl):
    """The TPU / GPU kernels in Pallas interpret mode (CPU), at 2 x 2 tiles of 128."""
    pos, seg = packed([[100, 120]], 256)
    q, k, v, w = qkv(jax.random.key(1), 1, 256, 256, 2, 1, 32)
    fn = lambda q, k, v: self_attention(q, k, v, pos, seg, scale=0.2, impl=impl)
    ref = lambda q, k, v: dense_attention(q, k, v, pos, seg, pos, seg, scale=0.2)
    assert_matches(fn, ref, q, k, v, w, seg != 0)


def test_auto_falls_back_with_a_log(monkeypatch, caplog):
    pos, seg = packed([[7, 9]], 20)   # a 20-token block: not a multiple of splash's 128
    q, k, v, _ = qkv(jax.random.key(2), 1, 20, 20, 4, 2, 8)
    with pytest.raises(KernelUnsupported, match="multiple"):
        self_attention(q, k, v, pos, seg, scale=0.3, impl="splash")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(attention_api, "chunked_attention", lambda *a, **kw: "chunked")
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        assert self_attention(q, k, v, pos, seg, scale=0.3, impl="auto") == "chunked"
    assert "splash cannot run this call" in caplog.text


def test_the_kernel_probe_runs_once_per_call_shape(monkeypatch):
    """Under ``"auto"`` the kernel's lowering probe runs once per call shape and mesh, not
    once per layer or retrace."""
    pos, seg = packed([[100, 120]], 256)
    q, k, v, _ = qkv(jax.random.key(4), 1, 256, 256, 2, 1, 32)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    probes = []
    monkeypatch.setattr(attention_api.dispatch, "lowering_error",
                        lambda *a, **kw: probes.append(a))  # None: it lowers
    attention_api._lowering_error.cache_clear()
    for _ in range(3):
        jax.eval_shape(lambda q, k, v: self_attention(q, k, v, pos, seg, scale=0.2), q, k, v)
    assert len(probes) == 1
    jax.eval_shape(lambda q: self_attention(q, k, v, pos, seg, scale=0.2), q[:, :, :1])
    assert len(probes) == 2  # another shape, another probe


def test_check_packing_and_config():
    pos, seg = packed([[4, 4]], 8)
    check_packing(pos, seg)
    with pytest.raises(ValueError, match="segment 2"):
        check_packing(pos.at[0, 6].set(0), seg)
    with pytest.raises(ValueError, match="attention_impl.*'flash'"):
        check_ops(get_config("tiny", attention_impl="flash"))


@pytest.mark.parametrize("t", [1, 5])
def test_cache_paths_match_dense(t):
    """Decode (T = 1, dense [1, L]) and prefill (T > 1, chunked) over a 24-slot cache with
    empty slots and two rows of different lengths."""
    slots = 24
    kv_pos, kv_seg = packed([[9 + t], [4 + t]], slots)
    kv_seg = jnp.where(jnp.arange(slots) < 16, kv_seg, 0)       # slots >= 16: not written
    pos = jnp.stack([jnp.arange(9, 9 + t), jnp.arange(4, 4 + t)]).astype(jnp.int32)
    seg = jnp.ones((2, t), jnp.int32)
    q, k, v, _ = qkv(jax.random.key(3), 2, t, slots, 4, 2, 8)
    args = (pos, seg, kv_pos, kv_seg)
    out = jax.jit(lambda *a: cache_attention(*a, scale=0.35))(q, k, v, *args)
    expect = jax.jit(lambda *a: dense_attention(*a, scale=0.35))(q, k, v, *args)
    assert rel(out, expect) <= RTOL


def layer_temp_bytes(cfg: ModelConfig, tokens: int) -> int:
    """XLA's temp allocation of one decoder layer's forward + backward at ``tokens``."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, 0, rngs=nnx.Rngs(0))))

    def loss(state, x, positions, segment_ids):
        y, _, _ = nnx.merge(graphdef, state)(x, positions, segment_ids)
        return y.astype(jnp.float32).sum()

    ids = jax.ShapeDtypeStruct((1, tokens), jnp.int32)
    x = jax.ShapeDtypeStruct((1, tokens, cfg.hidden_size), cfg.dtype)
    compiled = jax.jit(jax.grad(loss, (0, 1))).lower(state, x, ids, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_linear_in_length():
    """A Qwen3-0.6B layer (float32): 4x the tokens needs <= 4.5x the temp memory (the dense
    path needs ~14x, quadratic)."""
    cfg = get_config("qwen3-0.6b", num_hidden_layers=1, dtype="float32",
                     attention_impl="xla_chunked")
    small, large = layer_temp_bytes(cfg, 2048), layer_temp_bytes(cfg, 8192)
    assert large <= 4.5 * small, (small, large)


def scanned_attention_temp_bytes(tokens: int) -> int:
    """Compiled temporaries of ``jax.grad`` through ``chunked_attention`` in a 2-step
    ``lax.scan`` (a scanned layer stack: the positions and segment ids are loop-invariant,
    the queries are not), 256-token tiles, float32."""
    b, n, k, d = 1, 8, 2, 64

    def loss(w, x, kv, ids):
        def layer(h, wl):
            q = (h @ wl).reshape(b, tokens, n, d)
            kk = kv.reshape(b, tokens, k, d)
            return chunked_attention(q, kk, kk, ids, jnp.ones_like(ids), ids,
                                     jnp.ones_like(ids), scale=0.1, block_q=256,
                                     block_kv=256).reshape(h.shape), None

        return jax.lax.scan(layer, x, w)[0].sum()

    shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in
              ((2, n * d, n * d), (b, tokens, n * d), (b, tokens, k * d))]
    ids = jax.ShapeDtypeStruct((b, tokens), jnp.int32)
    compiled = jax.jit(jax.grad(loss, (0, 1, 2))).lower(*shapes, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_memory_linear_in_length_inside_a_layer_scan():
    """Reported (issue 14, TPU compiler, Qwen3-30B-A3B): inside a scan over layers, JAX's
    loop-invariant hoisting precomputed every tile's mask and masked fill for all (query
    block, key block) pairs, ``f32[8, 8, 1, 4, 8, 512, 512]`` (2 GiB) per layer at 4096
    tokens. 4x the tokens must need <= 4.5x the temporaries (that buffer: 16x)."""
    small, large = scanned_attention_temp_bytes(1024), scanned_attention_temp_bytes(4096)
    assert large <= 4.5 * small, (small, large)


def test_kernels_run_per_device_under_a_mesh():
    """8 CPU devices (subprocess): the kernels inside ``jax.shard_map`` equal the dense
    reference, forward and gradients; rows that do not split raise for an explicit
    kernel (``"auto"`` falls back to ``xla_chunked``)."""
    r = run_case("tests.models.sharding_cases:attention_kernels_case")
    for impl in ("splash", "pallas_gpu"):
        assert r[impl]["shard_map"], r
        assert r[impl]["loss"] <= 1e-3 and r[impl]["grads"] <= 1e-4, r
    assert r["auto_on_cpu_mesh"] == "xla_chunked"
    assert "rows (3)" in r["three_rows"] and "must split" in r["three_rows"], r
