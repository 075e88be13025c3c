"""Attention, a decoder layer and a small MoE GRPO step compiled by the real TPU compiler
for v4, v5e, v5p and v6e slices, on a machine without a TPU.

Needs ``libtpu`` (``pip install -e '.[tpu]'``); skipped without it. Under ``jax.set_mesh``
of a topology's devices ``attention_impl="auto"`` picks what a TPU would (JAX's splash
attention kernel), run per device inside ``jax.shard_map`` (a Mosaic kernel cannot be split
by XLA's partitioner: before, ``auto`` chose by ``jax.default_backend()``, so every compile
here used the XLA path, and on a TPU pod the kernel would have met the partitioner). A
fallback would log on logger ``"jaxhead"``: none is allowed.

~4 minutes on 2 cores (AMD EPYC; the GRPO step about half of it).
"""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("libtpu", reason="needs libtpu (pip install -e '.[tpu]') for the TPU compiler")

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh

from harness import tpu_compile as tc
from models.attention.api import self_attention
from models.config import get_config
from models.mesh import AXES
from models.transformer import DecoderLayer

MIB = 2**20


def _mesh(generation: str, **sizes):
    """The ``models.mesh`` axes over 4 chips of ``generation`` (as they come: one device
    per chip, which ``jax.make_mesh`` cannot arrange on v4's topology)."""
    shape = tuple(sizes.get(a, 1) for a in AXES)
    devices = np.array(tc.topology_devices(generation)[:4]).reshape(shape)
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def _kernels(lowered_text: str) -> int:
    return lowered_text.count("tpu_custom_call")


@pytest.mark.parametrize("generation", list(tc.TOPOLOGIES))
def test_splash_attention_compiles_per_device(generation, caplog):
    """Packed rows, GQA (32 query heads on 4 KV heads, Qwen3-30B-A3B's), bf16, forward and
    backward, rows over data x fsdp and heads over tensor: 4 chips, 2 x 4096 tokens."""
    b, t, n, k, d = 2, 4096, 32, 4, 128
    bf16 = jnp.bfloat16
    q = jax.ShapeDtypeStruct((b, t, n, d), bf16)
    kv = jax.ShapeDtypeStruct((b, t, k, d), bf16)
    ids = jax.ShapeDtypeStruct((b, t), jnp.int32)

    def loss(q, k, v, positions, segment_ids):
        out = self_attention(q, k, v, positions, segment_ids, scale=d ** -0.5)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with caplog.at_level(logging.WARNING, logger="jaxhead"), \
            jax.set_mesh(_mesh(generation, data=2, tensor=2)):
        lowered = jax.jit(jax.grad(loss, (0, 1, 2))).lower(q, kv, kv, ids, ids)
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
    assert "cannot run this call" not in caplog.text
    text = lowered.as_text()
    assert _kernels(text) >= 3 and "sdy.manual_computation" in text  # fwd, dq, dkv
    # per chip: 1 row x 16 query heads; a [T, T] f32 score matrix alone would be 1 GiB
    assert temp < 256 * MIB, temp / MIB


@pytest.mark.parametrize("kv_heads, sizes", [(8, {"fsdp": 2, "tensor": 2}),
                                              (2, {"tensor": 4})])
def test_decoder_layer_compiles_with_the_kernel(kv_heads, sizes, caplog):
    """One Qwen3-0.6B decoder layer (bf16), forward and backward, on v6e with fsdp=2 x
    tensor=2, and with 2 KV heads on tensor=4 (wider than the KV heads: each shard gets the
    KV head its query heads read, ``models.sharding.kv_head_layout``): 4 rows of 2048
    tokens; splash inside it, no fallback."""
    cfg = get_config("qwen3-0.6b", num_hidden_layers=1, dtype="bfloat16",
                     num_key_value_heads=kv_heads)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: DecoderLayer(cfg, 0, rngs=nnx.Rngs(0))))

    def loss(state, x, positions, segment_ids):
        y, _, _ = nnx.merge(graphdef, state)(x, positions, segment_ids)
        return y.astype(jnp.float32).sum()

    ids = jax.ShapeDtypeStruct((4, 2048), jnp.int32)
    x = jax.ShapeDtypeStruct((4, 2048, cfg.hidden_size), jnp.bfloat16)
    with caplog.at_level(logging.WARNING, logger="jaxhead"), \
            jax.set_mesh(_mesh("v6e", **sizes)):
        lowered = jax.jit(jax.grad(loss, (0, 1))).lower(state, x, ids, ids)
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
    assert "cannot run this call" not in caplog.text
    assert _kernels(lowered.as_text()) >= 3
    assert 0 < temp < 1024 * MIB, temp / MIB


def test_small_moe_grpo_step_compiles_on_a_mesh():
    """``harness.memory``'s GRPO-shaped train step (forward, sharded jaxhead head,
    backward, Adam) of the tiny MoE on v6e with fsdp=2 x expert=2: the Pallas head, the
    splash kernel and the ragged all-to-all all in one compiled program."""
    from harness.memory import measure

    row = measure("tiny-moe", {"data": 1, "fsdp": 2, "expert": 2}, batch=0, seq=256,
                  keep=0.5, layers=0, topology="v6e:2x2", dispatch="ragged")
    assert row["target"] == "TPU compiler (v6e:2x2)"
    assert row["peak"] >= row["params"] + row["adam"] > 0
    assert row["saved"] > 0 and len(row["largest"]) == 3
    assert row["kernels"] == 6, row  # the head's fwd / dh / dW, splash's fwd / dq / dkv


def test_context_parallel_grpo_step_compiles_on_a_v6e_slice():
    """The tiny MoE's GRPO step with each row's tokens over context=4 on a 64-chip v6e
    slice (fsdp=2 x expert=8 x context=4: a mesh ``jax.make_mesh`` cannot lay on the 8 x 8
    chips without splitting a physical axis): it compiles with the Pallas head and the
    gathered-K/V XLA attention (splash masks by index: refused under context)."""
    from harness.memory import measure

    row = measure("tiny-moe", {"data": 1, "fsdp": 2, "expert": 8, "context": 4}, batch=0,
                  seq=512, keep=0.5, layers=0, topology="v6e:8x8", dispatch="ragged")
    assert row["tokens"] == 128 and row["fits"] == "yes", row
    assert row["kernels"] == 3, row  # the head's fwd / dh / dW; no splash


def test_offload_moves_the_saved_layer_inputs_to_host_memory():
    """``remat_policy="offload"`` compiled by the TPU compiler: the tiny MoE's GRPO step
    keeps its saved layer inputs in host memory (``host_temp``). At this size the device
    saves little (the inputs are 0.5 MiB of 13 MiB of temporaries, and the copies need
    staging); the 30B rows of docs/scale-out.md show the device side."""
    from harness.memory import measure

    rows = {policy: measure("tiny-moe", {"data": 1, "fsdp": 2, "expert": 2}, batch=0,
                            seq=2048, keep=0.5, layers=0, remat=True, remat_policy=policy,
                            topology="v6e:2x2", dispatch="dense")
            for policy in ("nothing_saved", "offload")}
    kept, offload = rows["nothing_saved"], rows["offload"]
    assert kept["host_temp"] == 0 and offload["host_temp"] > 0, rows
    # each of the 2 layers' bf16 [1, 2048, 64] input per device
    assert offload["host_temp"] >= 2 * 2048 * 64 * 2 / 2**30, rows


def test_one_chip_step_compiles_with_the_kernels(caplog):
    """A one-device step is traced with no mesh in context: compiled for a TPU chip from a
    CPU host, ``impl="auto"`` and the head's lowering probe must still target the chip
    (they followed the host's backend: the v5e:1x1 rows measured XLA paths)."""
    from harness.memory import measure

    with caplog.at_level(logging.WARNING):
        row = measure("qwen3-0.6b", {"data": 1}, batch=0, seq=2048, keep=0.5, layers=1,
                      remat=True, topology="v5e:1x1", dispatch="dense")
    assert "cannot run this call" not in caplog.text
    # the head's fwd / dh / dW; splash's fwd (twice: remat runs it again), dq and dkv
    assert row["kernels"] == 7, row
