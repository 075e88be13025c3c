"""The head compiled for TPU pod slices by the real TPU compiler, on a machine without a TPU.

With ``libtpu`` installed (``pip install -e '.[tpu]'``),
``jax.experimental.topologies.get_topology_desc`` gives the devices of a TPU slice, and a
program jitted under ``jax.set_mesh`` of a mesh of them lowers and ``.compile()``s with
the TPU compiler: Mosaic kernels for real, per-device HBM from ``memory_analysis()``.
``jaxhead`` plans for that target (``impl="auto"`` picks ``pallas_tpu``, tiles fit the
generation's VMEM) as it would on the chip.

    python benchmarks/tpu_compile.py                         # the whole table (~30 min, 2 cores)
    python benchmarks/tpu_compile.py --generations v6e --shapes qwen3-30b
    python benchmarks/tpu_compile.py --generations v5p --shapes f32-temp --measure-vmem

Every row is ``jax.grad`` of ``sum(logp) + sum(entropy)`` (forward and backward) of one
head configuration, compiled for one generation:

* ``plain``: ``jaxhead.token_logprobs`` on one chip;
* ``sharded``: ``jaxhead.sharded_token_logprobs`` with the tokens split over 4 chips;
* ``vocab``: the vocab-parallel head, tokens over 2 chips x vocabulary over 2 (an XLA
  implementation: the kernels have no vocab-parallel variant).

Columns: generation, ``impl``, mode, shape (``N x H x V`` and dtype; ``N`` is the global
token count), options (``cap``: soft-cap 30, ``temp``: per-token temperature, ``minl``:
``min_logit``), the compile verdict, the kernel tiles ``T x C`` and the scoped-VMEM limit
the plan passes to Mosaic (``pallas_tpu`` only; with ``--measure-vmem`` also the smallest
limit each kernel compiles under, found by recompiling: forward / ``dh`` / ``dW``), and per
device: HBM of the arguments and the temporaries, and the peak, from the compiled
``memory_analysis()``; compile seconds.
"""

from __future__ import annotations

import argparse
import sys
import time

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax

from harness.tpu_compile import (
    MIB,
    SHAPES,
    TOPOLOGIES,
    Case,
    compile_case,
    kernel_vmem,
    mesh_for,
    topology_devices,
    tpu_plan,
)


def cases(shapes, impls, modes) -> list[Case]:
    """Every combination that exists: the vocab-parallel head is XLA-only."""
    out = []
    for name in shapes:
        for impl in impls:
            for mode in modes:
                if mode == "vocab" and impl == "pallas_tpu":
                    continue
                out.append(Case(**SHAPES[name], impl=impl, mode=mode))
    return out


def format_row(gen: str, row: dict) -> str:
    case = row["case"]
    cells = [gen, case.impl, case.mode, case.shape, case.options]
    if "error" in row:
        verdict = "FAIL " + row["error"][:160]
    else:
        verdict = f"OK ({row['kernels']} kernels)" if case.impl == "pallas_tpu" else "OK"
    cells.append(verdict)
    cells.append(row.get("tiles", "-"))
    cells.append(row.get("vmem", "-"))
    for key in ("args_mib", "temp_mib", "peak_mib"):
        cells.append(f"{row[key]:.0f}" if key in row else "-")
    cells.append(f"{row['compile_s']:.0f}")
    return "| " + " | ".join(cells) + " |"


HEADER = ("| gen | impl | mode | N x H x V | options | compiled | tiles T x C | VMEM MiB "
          "(limit; fwd/dh/dW) | args MiB | temp MiB | peak MiB | compile s |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generations", default=",".join(TOPOLOGIES),
                        help="comma-separated: v4, v5e, v5p, v6e (or topology names)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=",".join(SHAPES))
    parser.add_argument("--impls", default="xla,pallas_tpu")
    parser.add_argument("--modes", default="plain,sharded,vocab")
    parser.add_argument("--measure-vmem", action="store_true",
                        help="also find each kernel's real scoped VMEM (several compiles)")
    args = parser.parse_args(argv)
    try:
        import libtpu  # noqa: F401
    except ImportError:
        print("needs libtpu: pip install -e '.[tpu]'", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    print(f"jaxhead tpu_compile: jax {jax.__version__}, fwd+bwd of sum(logp) + sum(entropy)")
    print(HEADER, flush=True)
    ok = True
    for gen in args.generations.split(","):
        devices = topology_devices(gen)
        for case in cases(args.shapes.split(","), args.impls.split(","), args.modes.split(",")):
            row = compile_case(case, devices)
            ok &= "error" not in row
            if case.impl == "pallas_tpu":
                plan, _ = tpu_plan(case, mesh_for(devices, "plain"))
                row["tiles"] = f"{plan.block_tokens} x {plan.block_vocab}"
                row["vmem"] = f"{plan.vmem_limit_bytes / MIB:.1f}"
                if args.measure_vmem and case.mode == "plain":
                    row["vmem"] += "; " + "/".join(f"{x:.1f}" for x in kernel_vmem(case, devices))
            print(format_row(gen, row), flush=True)
    print(f"elapsed {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
