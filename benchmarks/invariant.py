"""The price of ``model.numerics = "invariant"``: rollout and update CPU seconds vs the
default numerics on one workload, and the sampler-trainer log-prob gap of each.

    python benchmarks/invariant.py                   # tiny preset, bf16 compute
    python benchmarks/invariant.py --preset tiny-moe # the MoE variant, + its MoE block
    python benchmarks/invariant.py --layers 4 --prompts 16 --group 8 --new-tokens 32

Workload (``harness.on_policy.workload``): a freshly initialised ``--preset`` decoder
(``models.PRESETS``; ``--layers`` of them) untied, ``--dtype`` compute, ``--prompts``
prompts of 8-40 tokens, ``--group`` samples each, ``--new-tokens`` tokens (no stop
token), the ``compact`` engine at temperature 1; then one GRPO update
(``train.rl.steps.grpo_step``: forward, backward, AdamW) on the rollout packed into rows of
``--row-len`` tokens. Each is compiled by a first call, then timed over ``--repeats``
calls (the median; process CPU seconds and wall seconds). The gap: ``|logp_trainer -
logp_sampler|`` over the completion tokens, max and mean (the step's ``logprob_diff_*``).
Then one layer's attention at the update's shape, ``"invariant"`` vs ``"xla_chunked"``;
for an MoE preset, one MoE block on as many tokens: the default dropless path and the
invariant one (``models.moe.invariant``: the router on row tiles, the experts in
expert-major tiles of one shape, the gradient the default path's).
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import jax.numpy as jnp
from flax import nnx

from harness import bench, on_policy
from harness.machine import describe
from models import Transformer, get_config
from models.attention import api as attention
from models.invariant import row_tiled


def _timed(fn, repeats: int) -> bench.Timing:
    """The medians of ``repeats`` calls after one (``harness.bench.rounds``)."""
    return bench.rounds({"call": fn}, repeats)["call"]


def measure(numerics: str, args) -> dict:
    recipe = {"scan_layers": True, "remat": True} if args.remat else None
    work = on_policy.workload(args.preset, numerics=numerics, dtype=args.dtype,
                              layers=args.layers, prompts=args.prompts, group=args.group,
                              new_tokens=args.new_tokens, row_len=args.row_len,
                              config=recipe)
    r_cpu, r_wall, _ = _timed(work.sample, args.repeats)
    u_cpu, u_wall, _ = _timed(work.update, args.repeats)
    gap = on_policy.gap(work)
    return {"rollout": (r_cpu, r_wall), "update": (u_cpu, u_wall),
            "gap": (gap["max"], gap["mean"]), "tokens": gap["tokens"]}


def attention_cost(args) -> dict:
    """CPU seconds of one layer's attention, forward and forward + backward, at the
    update's shape (8 packed rows of ``--row-len``), ``"invariant"`` vs ``"xla_chunked"``."""
    cfg = get_config(args.preset)
    b, t = 8, args.row_len
    n, k, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    keys = jax.random.split(jax.random.key(0), 3)
    q, kk, vv = (jax.random.normal(key, (b, t, h, d), args.dtype)
                 for key, h in zip(keys, (n, k, k)))
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    seg = jnp.ones((b, t), jnp.int32)
    out = {}
    for impl in ("xla_chunked", "invariant"):
        def f(q, k, v, impl=impl):
            return attention.self_attention(q, k, v, pos, seg, scale=d ** -0.5, impl=impl)

        grad = jax.jit(jax.value_and_grad(lambda *a, f=f: f(*a).astype(jnp.float32).sum(),
                                          (0, 1, 2)))
        fwd = jax.jit(f)
        out[impl] = tuple(_timed(lambda fn=fn: fn(q, kk, vv), args.repeats)[0]
                          for fn in (fwd, grad))
    return out


def moe_cost(args) -> dict:
    """CPU seconds of one MoE block (``--preset``'s), forward and forward + backward
    (input and all its weights), on ``8 x --row-len`` random tokens: the default path
    (``MoE.__call__``) and the invariant one (``MoE.route_tile`` on row tiles, then
    ``MoE.residual_block`` on a zero residual stream)."""
    cfg = get_config(args.preset, dtype=args.dtype, numerics="invariant")
    moe = Transformer(cfg, rngs=nnx.Rngs(0)).layers[0].mlp
    graph, params = nnx.split(moe)
    x = jax.random.normal(jax.random.key(0), (8 * args.row_len, cfg.hidden_size),
                          args.dtype)
    mask = jnp.ones(x.shape[:1], bool)

    def invariant(m, x, mask):
        _, weights, experts = row_tiled(m.route_tile, x, lead=1)
        return m.residual_block(jnp.zeros_like(x)[None], x[None], weights[None],
                                experts[None], mask[None])[0]

    paths = {"default": lambda m, x, mask: m(x[None], mask[None])[0][0],
             "invariant": invariant}
    out = {}
    for name, path in paths.items():
        def f(x, params, path=path):
            return path(nnx.merge(graph, params), x, mask)

        grad = jax.jit(jax.grad(lambda *a, f=f: f(*a).astype(jnp.float32).sum(), (0, 1)))
        out[name] = tuple(_timed(lambda fn=fn: fn(x, params), args.repeats)[0]
                          for fn in (jax.jit(f), grad))
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--layers", type=int, help="decoder layers (default: the preset's)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--row-len", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--remat", action="store_true",
                   help="the presets' training settings: scan_layers and remat (each layer "
                        "recomputed in the backward pass, in both numerics)")
    args = p.parse_args(argv)
    rows = {n: measure(n, args) for n in ("default", "invariant")}
    layers = f", {args.layers} layers" if args.layers else ""
    layers += ", scan_layers + remat" if args.remat else ""
    print(f"# model.numerics: {args.preset} preset{layers}, {args.dtype} compute, "
          f"{args.prompts} prompts x "
          f"{args.group} samples x {args.new_tokens} tokens "
          f"({rows['default']['tokens']} completion tokens); {describe()}")
    print("| numerics | rollout CPU s (wall) | update CPU s (wall) | logprob_diff max | "
          "mean |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        (rc, rw), (uc, uw), (gmax, gmean) = r["rollout"], r["update"], r["gap"]
        print(f"| {name} | {rc:.3f} ({rw:.3f}) | {uc:.3f} ({uw:.3f}) | {gmax:.3g} | "
              f"{gmean:.3g} |")
    base, inv = rows["default"], rows["invariant"]
    print(f"invariant / default CPU: rollout {inv['rollout'][0] / base['rollout'][0]:.2f}x, "
          f"update {inv['update'][0] / base['update'][0]:.2f}x")
    print(f"\n# one layer's attention, 8 rows x {args.row_len} tokens")
    print("| attention_impl | forward CPU s | forward + backward CPU s |")
    print("|---|---|---|")
    for impl, (fwd, both) in attention_cost(args).items():
        print(f"| {impl} | {fwd:.4f} | {both:.4f} |")
    if get_config(args.preset).num_experts:
        print(f"\n# one MoE block, {8 * args.row_len} tokens")
        print("| MoE path | forward CPU s | forward + backward CPU s |")
        print("|---|---|---|")
        for name, (fwd, both) in moe_cost(args).items():
            print(f"| {name} | {fwd:.4f} | {both:.4f} |")


if __name__ == "__main__":
    main()
