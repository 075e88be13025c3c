"""The pod presets' GRPO step at tiny size against its float32 one-device reference.

Run with 8 CPU devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``): by
``tests/train/test_fidelity.py`` in a subprocess, and by ``benchmarks/fidelity.py``, which
prints the errors over seeds that the test's bounds come from. Each architecture the presets train (dense with a tied head as Qwen3-0.6B, dense
untied, the MoE as Qwen3-30B-A3B) is built at tiny size with the presets' settings:
bfloat16 compute, float32 parameters, scanned layers, remat. The step is the trainer's GRPO
objective (``train.rl.steps.grpo_loss_fn``: clipped surrogate, k3 KL, entropy bonus, the MoE's
load-balancing loss) and its gradient, compiled by ``train.rl.placement.Placement`` on an
8-device mesh; the reference is the same parameters and batch in float32 compute, one
device, plain ``jax.jit``.

The batch is what the trainer packs from templated prompts: every prompt starts with the
same chat template, every completion repeats an answer tag and ends with the stop token,
so a few ids fill most positions (the embedding rows whose gradient sums over hundreds of
terms), and packing leaves padding tokens at row ends and whole padding rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models import get_config
from models.mesh import make_mesh

#: name -> (preset, overrides, mesh). The dense tied case runs tensor=4 over 2 KV heads.
CASES = {
    "dense_tied": ("tiny", {}, {"fsdp": 2, "tensor": 4}),
    "dense_untied": ("tiny", {"tie_word_embeddings": False}, {"data": 2, "fsdp": 2,
                                                             "tensor": 2}),
    "moe": ("tiny-moe", {"expert_dispatch": "ragged"}, {"fsdp": 2, "expert": 4}),
}
#: The presets' settings (configs/grpo_qwen3_0p6b.py, grpo_qwen3_30b_a3b.py), f32 params.
POD = {"dtype": "bfloat16", "param_dtype": "float32", "scan_layers": True, "remat": True}

#: The chat template before every question: id 7 stands for its most frequent piece (a
#: newline, a space), at most of its positions.
TEMPLATE = [7, 19, 7, 7, 7, 55, 7, 7, 7, 11, 7, 7, 7, 3, 7, 7, 7, 61]
ANSWER, STOP = [301, 7, 302], 2  # the answer tag in every completion, the stop token


def batch(seed: int, sequences: int = 32, row_len: int = 96, rows: int = 24):
    """A packed GRPO batch (``train.rl.packing.pack``) of templated sequences with the old
    log-probs and advantages the loss reads; ``rows`` leaves whole padding rows. About
    half of the real tokens are id 7."""
    from train.rl.packing import pack

    rng = np.random.default_rng(seed)
    prompts = [TEMPLATE + rng.integers(20, 500, rng.integers(3, 9)).tolist()
               for _ in range(sequences)]
    comps = []
    for _ in range(sequences):
        think = [7 if rng.random() < 0.6 else int(t)
                 for t in rng.integers(20, 500, rng.integers(2, 12))]
        comps.append(think + ANSWER + rng.integers(20, 40, 2).tolist() + ANSWER + [STOP])
    groups = rng.standard_normal(sequences // 4).astype(np.float32)
    adv = np.repeat(groups, 4)
    return pack(prompts, comps, row_len, num_rows=rows, values={
        "old_logp": [rng.uniform(-6.5, -5.5, len(c)) for c in comps],
        "advantages": [np.full(len(c), a, np.float32) for c, a in zip(comps, adv)]})


def _loss_and_grads(cfg, params, packed, mesh_sizes):
    """``(loss, grads, stats)`` of the trainer's GRPO objective under ``cfg`` on
    ``mesh_sizes`` (None: one device, plain ``jax.jit``)."""
    from train.rl import rl_loss, state, steps
    from train.rl.placement import Placement, place_batch

    mdef = state.ModelDef.of(cfg)
    lcfg = rl_loss.LossConfig(eps_low=0.2, eps_high=0.28, beta=0.04, kl_estimator="k3",
                              entropy_coef=0.01, aggregation="token-mean",
                              max_completion_len=32)
    loss_fn = steps.grpo_loss_fn(mdef, lcfg, temperature=1.0, skip=True)
    rng = np.random.default_rng(5)
    ref_logp = (packed.loss_mask * rng.uniform(-6.5, -5.5, packed.loss_mask.shape)
                ).astype(np.float32)

    def fn(params, b, ref, bucket):
        (loss, (metrics, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, b, ref, packed.num_seqs, bucket)
        return loss, grads, metrics

    if mesh_sizes is None:
        p = jax.tree.map(jnp.asarray, params)
        b = place_batch(packed.arrays("old_logp", "advantages"))
        out = jax.jit(fn, static_argnames="bucket")(p, b, jnp.asarray(ref_logp),
                                                    packed.bucket(16))
    else:
        placement = Placement(make_mesh(mesh_sizes), mdef)
        p = placement.place_params(params)
        b = place_batch(packed.arrays("old_logp", "advantages"), placement.mesh)
        ref = place_batch({"r": ref_logp}, placement.mesh)["r"]
        out = placement.jit(fn, static_argnames="bucket")(p, b, ref,
                                                          placement.bucket(packed, 16))
    return jax.device_get(out)


def errors(grads, ref) -> dict[str, tuple[float, float]]:
    """Parameter name -> ``(relative Frobenius error, worst row's relative error)`` of
    ``grads`` against ``ref`` (float64 arithmetic). A row is the gradient's slice along
    its last axis (an embedding row, one output unit of a projection, per layer and
    expert); the worst row is taken over rows whose reference norm is at least 10% of the
    tensor's largest row (rows the batch barely reaches have no relative error to speak
    of)."""
    out = {}
    for k, r in ref.items():
        g = np.asarray(grads[k], np.float64).reshape(-1, r.shape[-1])
        r = np.asarray(r, np.float64).reshape(-1, r.shape[-1])
        diff, norms = np.linalg.norm(g - r, axis=1), np.linalg.norm(r, axis=1)
        live = norms >= 0.1 * norms.max()
        out[k] = (float(np.linalg.norm(g - r) / np.linalg.norm(r)),
                  float((diff[live] / norms[live]).max()))
    return out


def fidelity_case(name: str, seed: int = 0, mesh: dict | None = None,
                  dtype: str = "bfloat16") -> dict:
    """Errors of case ``name``'s step (compute ``dtype``, the presets' bfloat16 by default)
    on its mesh (or ``mesh``) against the float32 one-device step: ``loss`` (relative),
    per-parameter ``grads`` (Frobenius, worst row), the repeated template id's embedding
    row, whether everything is finite, and the reference loss's value."""
    preset, overrides, case_mesh = CASES[name]
    mesh = mesh or case_mesh
    cfg = get_config(preset, **{**POD, "dtype": dtype}, **overrides)
    params = dict(_params(cfg, seed))
    packed = batch(seed)
    loss, grads, metrics = _loss_and_grads(cfg, params, packed, mesh)
    ref_loss, ref_grads, _ = _loss_and_grads(cfg.replace(dtype="float32"), params, packed,
                                             None)
    emb = "embed_tokens.embedding"
    tid = TEMPLATE[0]
    row = float(np.linalg.norm(np.asarray(grads[emb][tid], np.float64) - ref_grads[emb][tid])
                / np.linalg.norm(ref_grads[emb][tid]))
    return {"loss": float(abs(loss - ref_loss) / abs(ref_loss)), "ref_loss": float(ref_loss),
            "grads": errors(grads, ref_grads), "template_row": row,
            "template_count": int((packed.tokens == tid).sum()),
            "finite": bool(np.isfinite(loss)) and all(
                bool(np.isfinite(g).all()) for g in jax.tree.leaves(grads)),
            "dropped": float(metrics.get("moe_dropped_fraction", 0.0))}


def _params(cfg, seed):
    """Random float32 parameters: norm scales ``1 + 0.2 N(0, 1)``, every other weight
    ``0.1 N(0, 1)`` (logits spread over a few nats, routers far from uniform)."""
    from train.rl import state

    rng = np.random.default_rng(seed)
    for key, shape in state.ModelDef.of(cfg).abstract_params().items():
        noise = rng.standard_normal(shape.shape)
        yield key, (1.0 + 0.2 * noise if key.endswith("scale") else 0.1 * noise).astype(
            np.float32)


def all_cases(seed: int = 0) -> dict:
    """``fidelity_case`` for every case of ``CASES`` at the presets' bfloat16 compute, and
    the dense tied case in float32 compute (one subprocess)."""
    out = {name: fidelity_case(name, seed) for name in CASES}
    out["dense_tied_f32"] = fidelity_case("dense_tied", seed, dtype="float32")
    return out
