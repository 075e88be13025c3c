"""One GRPO train step with the head on kept tokens only (jaxhead's skipping) vs on every
token, at a realistic prompt / completion ratio. Prints a table: tokens/s,
``lm_head_token_fraction`` and the step's peak temporary memory (XLA's compiled memory
analysis, the step's own buffers besides its arguments and outputs).

    python benchmarks/grpo_step.py                      # Qwen vocabulary, small decoder
    python benchmarks/grpo_step.py --hidden 512 --layers 4 --prompt 384 --completion 128
    python benchmarks/grpo_step.py --preset qwen3-0.6b --prompt 205 --completion 51  # 4:1

``--preset`` takes a models preset's real shapes (Qwen3-0.6B: 28 layers, hidden 1024,
vocabulary 151,936, tied embedding) with float32 parameters, computing in ``--dtype``
(float32 by default: XLA:CPU emulates bf16 matmuls on CPUs without AVX512-BF16 / AMX,
several times slower); ``--layers`` keeps only that many of its layers (the table's first
line says how many ran).

The default ratio, ~192 prompt to ~64 completion tokens (a quarter of the tokens read by
the loss), is that of short-answer reasoning prompts; long chain-of-thought completions
raise the fraction.

Same loss and gradients either way (``tests/train/test_grpo_step.py``); only the cost
differs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import numpy as np

import models
from train.rl import packing, rl_loss, state, steps
from train.rl.optim import make_optimizer
from train.rl.placement import Placement, place_batch
from train.run.schema import base_config


def batch(args, rng) -> packing.PackedBatch:
    """``args.seqs`` random prompt + completion sequences (lengths jittered by ±25%)."""
    def lengths(mean):
        return rng.integers(int(mean * 0.75), int(mean * 1.25) + 1, args.seqs)

    prompts = [rng.integers(0, 151_000, n).tolist() for n in lengths(args.prompt)]
    comps = [rng.integers(0, 151_000, n).tolist() for n in lengths(args.completion)]
    return packing.pack(
        prompts, comps, args.row_len, row_multiple=1,
        values={"old_logp": [-rng.random(len(c)) * 3 for c in comps],
                "advantages": [np.full(len(c), rng.normal()) for c in comps]})


def model_config(args) -> models.ModelConfig:
    """The decoder measured: ``args.preset``'s shapes computing in ``args.dtype``
    (``--layers`` of them if given), or a small float32 decoder of width ``args.hidden``."""
    if args.preset:
        over = {"num_hidden_layers": args.layers} if args.layers else {}
        return models.get_config(args.preset, dtype=args.dtype, param_dtype="float32",
                                 **over)
    heads = max(args.hidden // 64, 1)
    return models.get_config(
        "tiny", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=3 * args.hidden, num_hidden_layers=args.layers or 2,
        num_attention_heads=heads, num_key_value_heads=max(heads // 2, 1), head_dim=64,
        dtype="float32", param_dtype="float32")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="", help="a models preset, e.g. qwen3-0.6b")
    p.add_argument("--dtype", default="float32", help="compute dtype with --preset")
    p.add_argument("--hidden", type=int, default=128, help="without --preset")
    p.add_argument("--layers", type=int, default=0,
                   help="decoder layers (default 2, or the preset's)")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompt", type=int, default=192, help="mean prompt tokens")
    p.add_argument("--completion", type=int, default=64, help="mean completion tokens")
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--row-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    cfg = model_config(args)
    args.hidden, args.layers, args.vocab = (cfg.hidden_size, cfg.num_hidden_layers,
                                            cfg.vocab_size)
    mdef = state.ModelDef.of(cfg)
    placement = Placement(models.make_mesh({"data": 1}, devices=jax.devices()[:1]), mdef)
    tx, _ = make_optimizer(base_config().train.optim, 100)
    packed = batch(args, np.random.default_rng(0))
    b = place_batch(packed.arrays("old_logp", "advantages"))
    total = packed.loss_mask.size
    real = int(np.count_nonzero(packed.segment_ids))
    rows = []
    for skip in (False, True):
        params = placement.init_params(0)
        opt_state = tx.init(params)
        bucket = packed.bucket() if skip else None
        fn = steps.grpo_step(mdef, tx, rl_loss.LossConfig(max_completion_len=args.completion),
                             temperature=1.0, skip=skip)
        compiled = fn.lower(params, opt_state, (b,), None, packed.num_seqs, bucket).compile()
        temp = compiled.memory_analysis().temp_size_in_bytes
        times = []
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            params, opt_state, m = fn(params, opt_state, (b,), None, packed.num_seqs, bucket)
            jax.block_until_ready(m)
            if i:  # the first call is warm-up
                times.append(time.perf_counter() - t0)
        sec = statistics.median(times)
        head_rows = bucket if skip else total
        rows.append((skip, head_rows, sec, temp))
    base = rows[0][2]
    print(f"GRPO train step: {args.preset or 'decoder'} H={args.hidden}, "
          f"layers={args.layers}, V={args.vocab}, {cfg.dtype} compute, "
          f"{args.seqs} sequences of ~{args.prompt} prompt + ~{args.completion} completion "
          f"tokens packed into {packed.tokens.shape[0]} rows of {args.row_len} "
          f"({real} real tokens, {packed.num_kept} kept), {jax.devices()[0].device_kind}, "
          f"median of {args.repeats}")
    print("| head on | tokens through the head | lm_head_token_fraction | step ms | "
          "tokens/s | speed-up | peak temp GiB |")
    print("|---|---|---|---|---|---|---|")
    for skip, head_rows, sec, temp in rows:
        print(f"| {'kept tokens (bucket)' if skip else 'every token'} | {head_rows} | "
              f"{head_rows / total:.3f} | {sec * 1e3:.0f} | {real / sec:,.0f} | "
              f"{base / sec:.2f}x | {temp / 2**30:.3f} |")


if __name__ == "__main__":
    main()
