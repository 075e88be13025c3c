"""Per-device memory of a sharded RL train step, from XLA's compiled memory analysis.

Nothing is allocated: the step is lowered on abstract shapes (``jax.ShapeDtypeStruct``)
for a mesh of fake CPU devices and compiled; ``Compiled.memory_analysis()`` then gives the
per-device sizes of XLA's buffer assignment. The step is the trainer's GRPO step
(``train.rl.steps.grpo_step``, ``harness.memory.measure``): decoder forward (expert-parallel
MoE), the head per token shard on the kept tokens, the GRPO loss, backward, an
``optax.adam`` update (float32 ``m`` and ``v``), parameters and optimizer state donated.
CPU buffer assignment approximates what a TPU or GPU compile would do (same program,
different fusion and scheduling).

    python benchmarks/memory.py                                  # Qwen3-30B-A3B, 64 devices
    python benchmarks/memory.py --mesh fsdp=4,expert=8,tensor=2
    python benchmarks/memory.py --mesh fsdp=2,expert=4 --seq 512 --layers 2   # quick
    python benchmarks/memory.py --topology v6e:8x8 --layers 2   # the TPU compiler's numbers

With ``--topology`` (needs ``libtpu``, ``pip install -e '.[tpu]'``; no TPU) the step is
compiled by the real TPU compiler for the devices of that slice
(``jax.experimental.topologies.get_topology_desc``): TPU fusion, scheduling and buffer
assignment, Mosaic kernels for the head. Without it the numbers are the CPU
approximation, and the ``compiled for`` column says which.

Expert dispatch (``--dispatch``, default ``both``: one row each): ``dense``, the
worst-case all-to-all blocks, or ``ragged``, ``jax.lax.ragged_all_to_all``
(``models.moe.ragged``), with ``--capacity-factor`` sizing its receive buffers (none:
the worst case). XLA:CPU has no ragged all-to-all: without ``--topology`` the ragged row
is its dense emulation ("ragged (emulated)"), so only TPU-compiler rows compare the two.

    python benchmarks/memory.py --topology v6e:8x8 --layers 2 --capacity-factor 2

Prints one markdown table row per mesh and dispatch, with the seconds spent lowering and
compiling; a step the TPU compiler cannot fit in HBM is a row too (``fits``: the temporaries
it needs and the HBM available, from its ``CompileTimeHbmOom`` error; no peak), and a breakdown of each step's memory: parameters and Adam moments (the shards'
exact sizes), what the forward saves for the backward (the residuals of the loss traced
unsharded at one device's tokens, ``saved_residuals``, besides the arguments; traced again
at half the tokens, what grows is activations, per device; the rest compute-dtype copies
of weights such as the head's ``[H, V]``, at full size; with remat and scan the
activations are the ``[L, tokens, H]`` layer inputs) and the largest temporaries of the compiled
program (per device, from the buffer assignment XLA dumps with ``xla_dump_to``).
The preset's ``scan_layers`` is kept (on for Qwen3-30B-A3B); ``--no-scan`` unrolls the
layers. ``--remat --remat-policy offload`` keeps the saved layer inputs in pinned host
memory (``models.scan.REMAT_POLICIES``): the ``host temporaries`` column, from
``memory_analysis().host_temp_size_in_bytes``; the peak is device memory only.

    python benchmarks/memory.py --topology v5e:8x8 --seq 32768 --remat --remat-policy offload
"""

from __future__ import annotations

import argparse
import math
import os

import checkout  # noqa: F401  (the checkout's packages on sys.path)

from harness.memory import CONFIG, measure, parse_mesh, shipped


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="qwen3-30b-a3b")
    parser.add_argument("--mesh", action="append", default=None,
                        help="axis sizes, e.g. fsdp=8,expert=8 (repeatable)")
    parser.add_argument("--batch", type=int, default=0,
                        help="global sequences (default: one per device)")
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--keep", type=float, default=0.5,
                        help="fraction of tokens a loss reads (sizes the head's bucket)")
    parser.add_argument("--layers", type=int, default=0, help="override num_hidden_layers")
    parser.add_argument("--remat", action="store_true",
                        help="recompute each decoder layer in the backward pass")
    parser.add_argument("--remat-policy", default="nothing_saved",
                        help="what --remat saves (ModelConfig.remat_policy): nothing_saved, "
                        "offload (the layer inputs in host memory), dots_saved")
    parser.add_argument("--no-scan", action="store_true",
                        help="unroll the layers even if the preset scans them")
    parser.add_argument("--topology", default=None,
                        help="compile for this TPU slice with the TPU compiler (needs "
                        "libtpu), e.g. v6e:8x8")
    parser.add_argument("--dispatch", choices=("dense", "ragged", "auto", "both"),
                        default="both",
                        help="expert all-to-all: worst-case dense blocks, ragged, both, or "
                        "auto (the platform's; the only one numerics=invariant accepts)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="ragged receive buffer: this times the balanced load "
                        "(default: the worst case)")
    parser.add_argument("--moe-token-chunk", type=int, default=None,
                        help="the MoE's tokens per chunk (ModelConfig.moe_token_chunk)")
    parser.add_argument("--config", default=CONFIG,
                        help="the trainer config (configs/<name>.py) whose dtypes, optimizer "
                             "and loss settings the step uses (default: %(default)s)")
    parser.add_argument("--numerics", default="default",
                        help="ModelConfig.numerics (default or invariant)")
    args = parser.parse_args(argv)
    try:
        meshes = [{"data": 1, **parse_mesh(m)} for m in (args.mesh or ["fsdp=8,expert=8"])]
    except ValueError as e:
        parser.error(str(e))
    devices = max(math.prod(m.values()) for m in meshes)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    settings = shipped(args.config)
    print(f"trainer config configs/{args.config}.py: {settings['dtype']} compute, "
          f"{settings['param_dtype']} parameters and optimizer moments, numerics "
          f"{args.numerics}\n")
    print("| preset | mesh | devices | tokens/device | params GiB | Adam m+v GiB | "
          "temporaries GiB | host temporaries GiB | peak GiB | fits | compile s | "
          "compiled for | dispatch | Mosaic kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    dispatches = ("dense", "ragged") if args.dispatch == "both" else (args.dispatch,)
    rows = []
    for mesh in meshes:
        for dispatch in dispatches:
            row = measure(args.preset, mesh, batch=args.batch, seq=args.seq, keep=args.keep,
                          layers=args.layers, remat=args.remat,
                          remat_policy=args.remat_policy,
                          topology=args.topology, scan=not args.no_scan, dispatch=dispatch,
                          capacity_factor=args.capacity_factor,
                          moe_token_chunk=args.moe_token_chunk, config=args.config,
                          numerics=args.numerics)
            peak = "-" if row["peak"] is None else f"{row['peak']:.3g}"
            print("| {preset} | {mesh} | {devices} | {tokens} | {params:.3g} | {adam:.3g} | "
                  "{temp:.3g} | {host_temp:.3g} | {p} | {fits} | {compile:.0f} | {target} | {dispatch} | "
                  "{kernels} |".format(**row, p=peak), flush=True)
            rows.append(row)
    print("\n| preset | dispatch | saved activations GiB | saved weight copies GiB "
          "(unsharded) | largest saved | "
          "largest temporaries of the compiled step (per device) |\n|---|---|---|---|---|---|")
    for row in rows:
        print("| {preset} | {dispatch} | {saved:.3g} | {weight_copies:.3g} | {s} | {a} |".format(
            **row, s="; ".join(row["largest_saved"]), a="; ".join(row["largest"]) or "-"))


if __name__ == "__main__":
    main()
