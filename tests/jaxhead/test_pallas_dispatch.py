"""``impl=`` dispatch to the Pallas kernels in ``jaxhead.token_logprobs``: ``"auto"`` by
backend, logged fallback to XLA, explicit kernels that cannot run, the interpret switch."""

from __future__ import annotations

import logging
from typing import get_args

import chex
import jax
import jax.numpy as jnp
import pytest

import jaxhead
from jaxhead._src.head import api, pallas_mode
from tests.jaxhead.pallas_cases import HIDDEN, assert_matches, batch, swap_head


@pytest.mark.parametrize(
    "backend, want",
    [("tpu", "pallas_tpu"), ("gpu", "pallas_triton"), ("cpu", "xla_cpu"), ("METAL", "xla")],
)
def test_auto_picks_by_backend(monkeypatch, backend, want):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert api.resolve_impl("auto") == want
    assert get_args(jaxhead.Impl) == api.REGISTRY.names == tuple(jaxhead.IMPLEMENTATIONS)
    for name in jaxhead.IMPLEMENTATIONS:
        assert api.resolve_impl(name) == name
    with pytest.raises(ValueError, match="pallas_triton"):
        api.resolve_impl("triton")


def test_a_config_names_its_implementation():
    assert api.resolve_impl("auto", jaxhead.PallasTpuConfig()) == "pallas_tpu"
    assert api.resolve_impl("auto", jaxhead.XlaConfig()) == "xla"
    assert api.resolve_impl("xla_cpu", jaxhead.XlaCpuConfig()) == "xla_cpu"
    with pytest.raises(TypeError, match="XlaCpuConfig.*got XlaConfig"):
        api.resolve_impl("xla_cpu", jaxhead.XlaConfig())
    with pytest.raises(ValueError, match="token_chunk must be an int >= 1, got 0"):
        jaxhead.XlaConfig(token_chunk=0)


def _forward(impl, data, **kw):
    """jitted forward; ``keep`` stays a concrete constant, so the bucket is its count."""
    hidden, weight, labels, keep, temp, _ = data

    @jax.jit
    def run(hidden, weight):
        out = jaxhead.token_logprobs(
            hidden, weight, labels, keep, temperature=temp, softcap=5.0, impl=impl, **kw
        )
        return out.logprobs, out.entropy

    return run(hidden, weight)


def test_auto_falls_back_to_xla_with_a_logged_reason(monkeypatch, caplog):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    data = batch(jnp.float16)  # the TPU kernel takes bf16 / float32 only
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        got = _forward("auto", data)
    assert "pallas_tpu" in caplog.text and "float16" in caplog.text
    chex.assert_trees_all_equal(got, _forward("xla", data))


def test_auto_on_gpu_runs_the_triton_kernel(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    calls = []
    real = jaxhead.IMPLEMENTATIONS["pallas_triton"]

    def spy(*args):
        calls.append(args[0])
        return real(*args)

    swap_head(monkeypatch, "pallas_triton", head=spy)
    data = batch(jnp.float32, seed=11)
    with pallas_mode.interpret():
        got = _forward("auto", data)
    assert len(calls) == 1 and calls[0].blocks.block_tokens == 64  # the default tile
    assert_matches(got, _forward("xla", data), jnp.float32)


def test_auto_probes_for_the_platform_compiled_for():
    """Under ``compile_for("gpu")`` on a CPU machine ``"auto"`` plans the Triton kernels
    and probes their lowering for CUDA (not for the CPU backend, which refuses every
    compiled Pallas kernel): no fallback, even in strict mode."""
    h = jax.ShapeDtypeStruct((64, HIDDEN), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((HIDDEN, 256), jnp.bfloat16)
    y = jax.ShapeDtypeStruct((64,), jnp.int32)

    def loss(h, w, y):
        out = jaxhead.token_logprobs(h, w, y)
        return jnp.sum(out.logprobs) + jnp.sum(out.entropy)

    with jaxhead.dispatch.compile_for("gpu"), jaxhead.dispatch.strict():
        lowered = jax.jit(jax.grad(loss, (0, 1))).trace(h, w, y).lower(
            lowering_platforms=("cuda",))
    assert lowered.as_text().count("__gpu$xla.gpu.triton") == 2  # forward, backward du


@pytest.mark.parametrize("impl", ["pallas_tpu", "pallas_triton"])
def test_explicit_kernel_that_cannot_run_raises(impl):
    hidden = jnp.ones((4, HIDDEN), jnp.float32)
    weight = jnp.ones((HIDDEN, 256), jnp.float32)
    labels = jnp.arange(4)
    with pytest.raises(jaxhead.KernelUnsupported, match="JAXHEAD_PALLAS_INTERPRET"):
        jaxhead.token_logprobs(hidden, weight, labels, impl=impl)


def test_interpret_switch(monkeypatch):
    for raw, mode in [("1", "interpret"), ("races", "races"), ("0", None), ("", None)]:
        monkeypatch.setenv(pallas_mode.ENV_VAR, raw)
        assert pallas_mode.interpret_mode() == mode
    monkeypatch.setenv(pallas_mode.ENV_VAR, "1")
    with pallas_mode.interpret(None):
        assert pallas_mode.interpret_mode() is None
        with pallas_mode.interpret("races"):
            assert pallas_mode.interpret_mode() == "races"
        assert pallas_mode.interpret_mode() is None
    assert pallas_mode.interpret_mode() == "interpret"
    monkeypatch.setenv(pallas_mode.ENV_VAR, "yes")
    with pytest.raises(ValueError, match=pallas_mode.ENV_VAR):
        pallas_mode.interpret_mode()
    with pytest.raises(ValueError, match="mode"), pallas_mode.interpret("fast"):
        pass
