"""The pod presets' GRPO step at tiny size (bf16 compute, f32 params, scanned, remat) on
8-device CPU meshes against the float32 one-device step, over seeds: the relative errors
that ``tests/train/test_fidelity.py`` bounds (``harness/fidelity.py``).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \\
        python benchmarks/fidelity.py --seeds 5
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)

from harness import fidelity


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    runs = [fidelity.all_cases(seed) for seed in range(args.seeds)]
    print(f"| case (mesh) | loss | worst tensor, Frobenius | worst row | template row "
          f"| over {args.seeds} seeds |")
    print("|---|---|---|---|---|---|")
    for name in runs[0]:
        ds = [r[name] for r in runs]
        fro = [max(v[0] for v in d["grads"].values()) for d in ds]
        row = [max(v[1] for v in d["grads"].values()) for d in ds]
        worst = max(ds[0]["grads"], key=lambda k: ds[0]["grads"][k][0])
        mesh = fidelity.CASES[name.removesuffix("_f32")][2]
        mesh = " x ".join(f"{a}={n}" for a, n in mesh.items())
        print(f"| {name} ({mesh}) | {max(d['loss'] for d in ds):.1e} | {max(fro):.1e} "
              f"({worst}) | {max(row):.1e} | {max(d['template_row'] for d in ds):.1e} "
              f"| finite: {all(d['finite'] for d in ds)} |")


if __name__ == "__main__":
    main()
