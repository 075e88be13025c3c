"""The sampler-trainer mismatch of issue #41: ``|logp_trainer - logp_sampler|`` per
completion token, default vs ``model.numerics = "invariant"``, dense and MoE.

    python benchmarks/mismatch.py                    # 4 layers, bf16, 3 rollouts each
    python benchmarks/mismatch.py --models tiny --seeds 5

Each row: ``--seeds`` rollouts of the workload of ``harness.on_policy`` (a freshly
initialised preset with ``--layers`` decoder layers, untied, ``--dtype`` compute;
``--prompts`` prompts x ``--group`` samples x ``--new-tokens`` tokens, the ``compact``
engine at temperature 1), the same prompts and keys for every row, each scored by one
GRPO step's forward on the packed rollout (the loop's own ``logprob_diff_*``). Columns:
the mean and max over every completion token of every rollout, whether the two agree bit
for bit on all of them (``np.array_equal``) and, for an MoE model, the share of
(token, layer) expert choices that differ between the sampler and the trainer (``n/a``
until the engine records its routes). A mode the config check refuses for a model
(``models.invariant.check_config``: MoE before it has an invariant variant) prints the
refusal instead of numbers, so the table fills in when the check accepts it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout's packages
from harness import on_policy
from harness.machine import describe
from models import get_config

NUMERICS = ("default", "invariant")


def row(preset: str, numerics: str, args) -> dict:
    """The mismatch of ``numerics`` on ``preset`` over ``args.seeds`` rollouts, or
    ``{"refused": message}``."""
    diffs, equal = [], True
    for seed in range(args.seeds):
        try:
            work = on_policy.workload(preset, numerics=numerics, dtype=args.dtype,
                                      layers=args.layers, prompts=args.prompts,
                                      group=args.group, new_tokens=args.new_tokens,
                                      row_len=args.row_len, seed=seed)
        except ValueError as err:
            return {"refused": str(err)}
        g = on_policy.gap(work)
        diffs.append(g["diff"])
        equal &= g["equal"]
    diff = np.concatenate(diffs)
    return {"mean": float(diff.mean()), "max": float(diff.max()), "equal": equal,
            "tokens": diff.size}


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
    print("| model | numerics | tokens | logprob_diff mean | logprob_diff max | bit for bit "
          "| expert disagreement |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.models.split(","):
        moe = get_config(preset).num_experts > 0
        for numerics in NUMERICS:
            r = row(preset, numerics, args)
            if "refused" in r:
                print(f"| {preset} | {numerics} | refused: {r['refused']} | | | | |")
                continue
            print(f"| {preset} | {numerics} | {r['tokens']} | {r['mean']:.3g} | "
                  f"{r['max']:.3g} | {'yes' if r['equal'] else 'no'} | "
                  f"{'n/a' if moe else '-'} |", flush=True)


if __name__ == "__main__":
    main()
