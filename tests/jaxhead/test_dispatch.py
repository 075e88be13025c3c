"""``jaxhead.dispatch``: the platform picker follows the mesh, ``Registry.resolve`` picks
the first implementation that runs (logging each one skipped), names an unknown choice;
attention falls back when its kernel's lowering probe fails."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from jaxhead import dispatch
from jaxhead.dispatch import Entry, KernelUnsupported, Registry, Unlowered


def _registry() -> Registry:
    return Registry("op_impl", [Entry("fast", "f", platforms=("tpu",)), Entry("lowers", "l"),
                                Entry("portable", "p"), Entry("ref", "r", auto=False)])


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
    def check(name):
        if name == "fast":
            raise KernelUnsupported("block of 100 is not a multiple of 128")
        if name == "lowers":
            return Unlowered("MosaicError: bad layout")
        return name.upper()

    with caplog.at_level(logging.WARNING, logger="jaxhead"):
        assert _registry().resolve("auto", check, platform="tpu") == ("portable", "PORTABLE")
    assert "fast cannot run this call (block of 100 is not a multiple of 128); using " \
           "'portable'" in caplog.text
    assert "lowers cannot run this call (its kernels do not lower for this platform " \
           "(MosaicError: bad layout))" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="jaxhead"):  # off TPU "fast" is not tried
        assert _registry().resolve("auto", platform="cpu") == ("lowers", None)
    assert caplog.text == ""


def test_explicit_names_raise_and_unknown_names_list_the_choices():
    def refuse(name):
        raise KernelUnsupported(f"{name} refuses")

    with pytest.raises(KernelUnsupported, match="ref refuses"):
        _registry().resolve("ref", refuse)
    with pytest.raises(KernelUnsupported, match="no implementation.*fast: fast refuses"):
        _registry().resolve("auto", refuse, platform="tpu")
    with pytest.raises(ValueError, match=r"op_impl must be 'auto' or one of \('fast', "
                                         r"'lowers', 'portable', 'ref'\), got 'slow'"):
        _registry().resolve("slow")


def test_lowering_error_names_the_failure():
    assert dispatch.lowering_error(lambda x: x + 1, jax.ShapeDtypeStruct((3,), np.float32)) \
        is None

    def broken(x):
        raise NotImplementedError("no rule for this op")

    got = dispatch.lowering_error(broken, jax.ShapeDtypeStruct((3,), np.float32))
    assert got == "NotImplementedError: no rule for this op"


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
