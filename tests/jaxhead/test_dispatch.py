"""``jaxhead.dispatch``: the platform picker follows the mesh, ``Registry.resolve`` picks
the first implementation that runs (logging each one skipped), names an unknown choice;
attention falls back when its kernel's lowering probe fails."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jaxhead import dispatch
from jaxhead.dispatch import Entry, KernelUnsupported, Registry


def _check(name):
    """A check: "fast" refuses, "boom" fails (a bug), the others plan their name."""
    def check(query):
        if name == "fast":
            raise KernelUnsupported("block of 100 is not a multiple of 128")
        if name == "boom":
            raise RuntimeError("a bug in the kernel")
        return f"{name}-plan-{query}"
    return check


def _registry(*first) -> Registry:
    """fast (tpu) -> lowers (probed: refuses) -> portable -> ref (not auto)."""
    def entry(name, **kw):
        return Entry(name, lambda plan, x: (plan, x), check=_check(name), **kw)

    return Registry("op_impl", [*(entry(n, platforms=("tpu",)) for n in first),
                                entry("fast", platforms=("tpu",)),
                                entry("lowers", probe=lambda plan, q: "MosaicError: bad layout"),
                                entry("portable"), entry("ref", auto=False)])


def test_platform_follows_the_mesh_in_context(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices("cpu")[:1])
    assert dispatch.target_platform() == "tpu"  # no mesh: the default backend
    assert dispatch.target_platform(mesh) == "cpu"  # a given mesh: its devices
    with jax.set_mesh(mesh):
        assert dispatch.target_platform() == "cpu"
        with dispatch.compile_for("gpu"):
            assert dispatch.target_platform() == "gpu"


def test_auto_falls_back_with_a_logged_reason(caplog):
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        choice = _registry().resolve("auto", 7, platform="tpu")
    assert (choice.name, choice.plan, choice(1)) == ("portable", "portable-plan-7",
                                                     ("portable-plan-7", 1))
    assert "fast cannot run this call (block of 100 is not a multiple of 128); using " \
           "'portable'" in caplog.text
    assert "lowers cannot run this call (its kernels do not lower for this platform " \
           "(MosaicError: bad layout))" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxhead"):  # off TPU "fast" is not tried
        assert _registry().resolve("auto", 7, platform="cpu").name == "portable"
    assert "fast" not in caplog.text
    # an explicit name is checked, not probed
    assert _registry().resolve("lowers", 7).plan == "lowers-plan-7"
    # first: tried before the platform's order
    assert _registry().resolve("auto", 7, platform="cpu", first="ref").name == "ref"


def test_strict_mode_makes_a_fallback_an_error(caplog):
    with dispatch.strict():
        assert dispatch.is_strict()
        with pytest.raises(KernelUnsupported, match="strict: fast cannot run this call on "
                                                    "'tpu' .block of 100"):
            _registry().resolve("auto", 7, platform="tpu")
        with dispatch.strict(False):
            assert _registry().resolve("auto", 7, platform="tpu").name == "portable"
        assert _registry().resolve("portable", 7).name == "portable"  # no fallback: fine
    assert not dispatch.is_strict()


def test_a_failing_check_raises_instead_of_falling_back():
    with pytest.raises(RuntimeError, match="a bug in the kernel"):
        _registry("boom").resolve("auto", 7, platform="tpu")
    with pytest.raises(ValueError, match="repeat"):
        Registry("op_impl", [Entry("a", None), Entry("a", None)])


def test_explicit_names_raise_and_unknown_names_list_the_choices():
    with pytest.raises(KernelUnsupported, match="not a multiple of 128"):
        _registry().resolve("fast", 7)
    refusing = Registry("op_impl", [Entry("fast", None, check=_check("fast"))])
    with pytest.raises(KernelUnsupported, match="no implementation.*fast: block of 100"):
        refusing.resolve("auto", 7, platform="cpu")
    with pytest.raises(ValueError, match=r"op_impl must be 'auto' or one of \('fast', "
                                         r"'lowers', 'portable', 'ref'\), got 'slow'"):
        _registry().resolve("slow")
    swapped = _registry().replace(Entry("fast", None, platforms=("tpu",)))
    assert swapped.names == _registry().names and swapped.resolve("auto", platform="tpu") \
        .name == "fast"


def test_lowering_error_names_the_compilers_refusal_and_raises_the_rest():
    x = jax.ShapeDtypeStruct((8, 128), np.float32)
    assert dispatch.lowering_error(lambda x: x + 1, x) is None

    def add_one(x_ref, o_ref):
        o_ref[...] = x_ref[...] + 1

    kernel = pl.pallas_call(add_one, out_shape=x)  # compiled: XLA:CPU refuses to lower it
    assert dispatch.lowering_error(kernel, x, platform="cpu") == \
        "ValueError: Only interpret mode is supported on CPU backend."

    def broken(x):  # fails while tracing: a bug (or the kernel's own refusal), raised
        raise NotImplementedError("no rule for this op")

    with pytest.raises(NotImplementedError, match="no rule"):
        dispatch.lowering_error(broken, x)


def test_attention_auto_falls_back_when_the_kernel_does_not_lower(monkeypatch, caplog):
    from models.attention import api as attention_api
    from tests.models.test_attention import packed, qkv

    pos, seg = packed([[100, 28]], 128)  # a length splash accepts
    q, k, v, _ = qkv(jax.random.key(3), 1, 128, 128, 4, 2, 8)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(dispatch, "lowering_error", lambda *a, **kw: "MosaicError: no")
    monkeypatch.setattr(attention_api, "chunked_attention", lambda *a, **kw: "chunked")
    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        assert attention_api.self_attention(q, k, v, pos, seg, scale=0.3) == "chunked"
    assert "splash cannot run this call (its kernels do not lower for this platform " \
           "(MosaicError: no)); using 'xla_chunked'" in caplog.text
