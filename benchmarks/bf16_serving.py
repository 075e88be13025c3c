"""What a bfloat16 export computes where transformers serves it, against the trainer's
forward passes, on a random model of a preset's architecture (``harness/bf16_serving.py``;
the numbers of docs/export.md):

    JAX_PLATFORMS=cpu python benchmarks/bf16_serving.py --preset qwen3-0.6b --rows 4 --len 128
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import numpy as np

from harness import bf16_serving
from harness.machine import describe
from models import get_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = get_config(args.preset)
    tokens = np.random.default_rng(args.seed + 1).integers(0, cfg.vocab_size,
                                                           (args.rows, args.len))
    equal = bf16_serving.norm_outputs_bit_equal(cfg.hidden_size, seed=args.seed)
    gaps = bf16_serving.logprob_gaps(cfg, tokens, seed=args.seed)
    print(f"{describe()}; {args.preset} (random weights), {args.rows} x {args.len} random tokens")
    print(f"RMSNorm outputs bit-equal, ours vs transformers' (bf16): {equal:.1%}")
    print("| compared | mean abs log-prob difference (nats / token) |")
    print("|---|---|")
    print(f"| transformers on the bf16 export vs our bf16 forward | {gaps['served_bf16']:.4f} |")
    print(f"| our bf16 forward vs our float32 forward | {gaps['ours_bf16_vs_f32']:.4f} |")
    print(f"| transformers on the float32 export vs our float32 forward | "
          f"{gaps['served_f32']:.1e} |")


if __name__ == "__main__":
    main()
