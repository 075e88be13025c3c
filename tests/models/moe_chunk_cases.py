"""Cases of ``ModelConfig.moe_token_chunk`` (the MoE's experts on a device's tokens in
sequential chunks), used by ``tests/models/test_moe_chunk.py``: the random tiny MoE on a
packed batch with padding, chunked against unchunked (outputs, every gradient, the aux
loss and the dropped fraction), on one device in the test process and on fsdp=2 x
expert=4 (dense and ragged dispatch) in a subprocess with 8 CPU devices; and the
compiled temporaries of one MoE layer's forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import get_config
from models.moe.layer import MoE
from tests.models.padding_cases import packed_batch
from tests.models.sharding_cases import compare_on_mesh
from tests.support.models import random_model

MESH = {"fsdp": 2, "expert": 4}
#: Tokens per chunk on the mesh (16 tokens per device): 4 rounds, and 3 rounds of 6 with
#: 2 padding tokens added.
MESH_CHUNKS = (4, 6)


def chunk_batch() -> dict:
    """8 packed rows of 16 tokens (several sequences a row, tail padding)."""
    arrays, _ = packed_batch(rows=8, row_len=16)
    return {k: arrays[k] for k in ("tokens", "positions", "segment_ids")}


def model(chunk: int | None, dispatch: str = "auto"):
    """``(graphdef, state)`` of the random float32 tiny-moe (same weights for every
    ``chunk``)."""
    cfg = get_config("tiny-moe", dtype="float32", expert_dispatch=dispatch,
                     moe_token_chunk=chunk)
    return nnx.split(random_model(cfg, seed=3))


def step(graphdef):
    """``state, batch -> {hidden, aux, dropped, grads}``: the decoder, and the gradient of
    ``sum(hidden * w) + aux_loss`` (``w`` a fixed ``[H]`` cotangent) for every
    parameter."""

    def run(state, batch):
        def loss(state):
            out = nnx.merge(graphdef, state)(batch["tokens"], batch["positions"],
                                             batch["segment_ids"])
            w = jnp.cos(jnp.arange(out.hidden.shape[-1], dtype=jnp.float32))
            return jnp.sum(out.hidden * w) + out.aux_loss, out

        (_, out), grads = jax.value_and_grad(loss, has_aux=True)(state)
        return {"hidden": out.hidden, "aux": out.aux_loss, "dropped": out.dropped_fraction,
                "grads": grads}

    return run


def relative(got, ref) -> dict:
    """Per output (``hidden``, ``grads``: the worst leaf, ``aux``, ``dropped``): max
    ``|got - ref|`` over max ``|ref|`` (absolute where ``ref`` is 0)."""

    def rel(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = np.abs(b).max()
        return float(np.abs(a - b).max() / (scale if scale > 0 else 1.0))

    return {k: max(rel(a, b) for a, b in zip(jax.tree.leaves(got[k]), jax.tree.leaves(ref[k]),
                                             strict=True))
            for k in ("hidden", "grads", "aux", "dropped")}


def one_device(chunk: int) -> dict:
    """``relative`` of the chunked model to the unchunked one, one device."""
    batch = chunk_batch()
    outs = [jax.jit(step(g))(s, batch) for g, s in (model(None), model(chunk))]
    return {**relative(outs[1], outs[0]), "aux_value": float(outs[0]["aux"])}


def mesh_case() -> dict:
    """On fsdp=2 x expert=4, per dispatch path: ``relative`` of each chunk of
    ``MESH_CHUNKS`` to the unchunked run on the mesh, and the compiled temporaries (bytes
    per device) of the step with and without chunks."""
    batch = chunk_batch()
    out = {}
    for dispatch in ("dense", "ragged"):
        runs = {}
        for chunk in (None, *MESH_CHUNKS):
            graphdef, state = model(chunk, dispatch)
            _, _, got, lowered, _ = compare_on_mesh(step(graphdef), state, batch, MESH)
            runs[chunk] = got, lowered.compile().memory_analysis().temp_size_in_bytes
        base, temp = runs.pop(None)
        out[dispatch] = {str(c): {**relative(got, base), "temp": t}
                         for c, (got, t) in runs.items()}
        out[dispatch]["temp_unchunked"] = temp
        out[dispatch]["aux_value"] = float(base["aux"])
    return out


def layer_temp_bytes(tokens: int, chunk: int | None) -> int:
    """Compiled temporaries (``memory_analysis().temp_size_in_bytes``) of one float32
    tiny-moe ``MoE`` layer's forward and backward (gradients of the parameters and the
    input) on ``tokens`` tokens, one device, from abstract shapes."""
    cfg = get_config("tiny-moe", dtype="float32", moe_token_chunk=chunk)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: MoE(cfg, rngs=nnx.Rngs(0))))

    def loss(state, x, mask):
        y, stats = nnx.merge(graphdef, state)(x, mask)
        return jnp.sum(y * y) + jnp.sum(stats.probs)

    x = jax.ShapeDtypeStruct((1, tokens, cfg.hidden_size), jnp.float32)
    mask = jax.ShapeDtypeStruct((1, tokens), bool)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(state, x, mask).compile()
    return compiled.memory_analysis().temp_size_in_bytes
