"""The sampler-trainer mismatch of issue #41: ``|logp_trainer - logp_sampler|`` per
completion token and the expert disagreement rate, default vs routing replay vs
``model.numerics = "invariant"``, dense and MoE.

    python benchmarks/mismatch.py                    # 4 layers, bf16, 3 rollouts each
    python benchmarks/mismatch.py --models tiny --seeds 5

Each model: ``--seeds`` rollouts of the workload of ``harness.on_policy`` (a freshly
initialised preset with ``--layers`` decoder layers, untied, ``--dtype`` compute;
``--prompts`` prompts x ``--group`` samples x ``--new-tokens`` tokens, the ``compact``
engine at temperature 1, an MoE model's experts recorded), the same prompts and keys for
every row, each scored by one GRPO step's forward on the packed rollout (the loop's own
``logprob_diff_*``). Three modes: ``default``; ``routing replay`` (the step's
``routing_replay``, R3: the same rollouts as ``default``, the trainer's MoE layers take the
sampler's recorded experts; a dense model has no router and prints ``n/a``); ``invariant``
(``numerics="invariant"`` on both sides, its own rollouts of the same prompts and keys).
Columns: the mean and max over every completion token of every rollout, whether the two
agree bit for bit on all of them (``np.array_equal``) and, for an MoE model, the step's
``expert_disagreement`` (the fraction of the sampler's recorded (token, MoE layer, slot)
routes, prompt tokens included, that the trainer's forward did not take), pooled over the
rollouts. A mode the config check refuses for a model (``models.invariant.check_config``)
prints the refusal instead of numbers.
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import numpy as np

from harness import on_policy
from harness.machine import describe
from models import get_config

#: The table's modes: (name, ``model.numerics``, the step's ``routing_replay``).
MODES = (("default", "default", False), ("routing replay", "default", True),
         ("invariant", "invariant", False))


def rows(preset: str, args) -> dict:
    """Mode name -> the mismatch of that mode on ``preset`` over ``args.seeds`` rollouts:
    ``mean``, ``max`` (nats), ``equal``, ``tokens``, ``disagreement`` (None for a dense
    model); ``{"refused": message}`` for a mode the model refuses, ``{"no_router": True}``
    for routing replay on a dense model. ``default`` and ``routing replay`` score the same
    rollouts."""
    moe = get_config(preset).num_experts > 0
    acc = {name: {"diffs": [], "equal": True, "differ": 0.0, "routes": 0}
           for name, _, _ in MODES}
    out = {} if moe else {"routing replay": {"no_router": True}}
    for seed in range(args.seeds):
        works = {}
        for name, numerics, replay in MODES:
            if name in out:
                continue
            if numerics not in works:
                try:
                    works[numerics] = on_policy.workload(
                        preset, numerics=numerics, dtype=args.dtype, layers=args.layers,
                        prompts=args.prompts, group=args.group, new_tokens=args.new_tokens,
                        row_len=args.row_len, seed=seed)
                except ValueError as err:
                    out[name] = {"refused": str(err)}
                    continue
            g = on_policy.gap(works[numerics], routing_replay=replay)
            a = acc[name]
            a["diffs"].append(g["diff"])
            a["equal"] &= g["equal"]
            if moe:
                a["differ"] += g["expert_disagreement"] * g["routes"]
                a["routes"] += g["routes"]
    for name, _, _ in MODES:
        if name in out:
            continue
        a = acc[name]
        diff = np.concatenate(a["diffs"])
        out[name] = {"mean": float(diff.mean()), "max": float(diff.max()),
                     "equal": a["equal"], "tokens": diff.size,
                     "disagreement": a["differ"] / max(a["routes"], 1) if moe else None}
    return out


def line(preset: str, name: str, r: dict) -> str:
    """One table row."""
    if "refused" in r:
        return f"| {preset} | {name} | refused: {r['refused']} | | | | |"
    if "no_router" in r:
        return f"| {preset} | {name} | n/a (no router) | | | | |"
    dis = "-" if r["disagreement"] is None else f"{r['disagreement']:.3g}"
    return (f"| {preset} | {name} | {r['tokens']} | {r['mean']:.3g} | {r['max']:.3g} | "
            f"{'yes' if r['equal'] else 'no'} | {dis} |")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="tiny,tiny-moe", help="presets, comma-separated")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--row-len", type=int, default=128)
    args = p.parse_args(argv)
    print(f"# sampler vs trainer log-probs: {args.layers} layers, {args.dtype} compute, "
          f"{args.seeds} rollouts of {args.prompts} prompts x {args.group} samples x "
          f"{args.new_tokens} tokens; {describe()}")
    print("| model | mode | tokens | logprob_diff mean | logprob_diff max | bit for bit "
          "| expert disagreement |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.models.split(","):
        table = rows(preset, args)
        for name, _, _ in MODES:
            print(line(preset, name, table[name]), flush=True)


if __name__ == "__main__":
    main()
