"""One-GPU check of the Triton head kernel: correctness vs the XLA path, time, memory.

    python benchmarks/gpu_check.py             # N=16384, H=4096, V=151936 bf16 on one GPU
    python benchmarks/gpu_check.py --dry-run   # CPU, Pallas interpret mode, tiny sizes
    python benchmarks/gpu_check.py --triton-blocks 128,128,64,8,3   # other Triton tiles
    python benchmarks/gpu_check.py --resources # no GPU: sm_90 registers / shared / spills

Runs forward + backward (``jax.value_and_grad`` of an RL-like loss that reads log-probs and
entropy) for three implementations and prints one table:

* ``reference``: plain JAX, full ``[N, V]`` logits (``jaxhead.reference_token_logprobs``);
* ``xla``: the chunked XLA path (``jaxhead.token_logprobs(impl="xla")``);
* ``pallas_triton``: the Triton kernels (``impl="pallas_triton"``).

Columns: median wall time of a step (after compile and one warm-up), useful TFLOP/s
(``6 N H V``: forward ``2 N H V`` plus the ``d hidden`` and ``d W`` matmuls, no recompute
counted) and that rate as a share of the measured bf16 matmul rate of the device (an
``M x M x M`` ``jnp.dot``), the peak memory XLA planned for the compiled step
(``memory_analysis().peak_memory_in_bytes``, or arguments + outputs + temporaries), and
max absolute differences to the XLA path for log-probs, entropy, ``d hidden`` and ``d W``
(computed in float32; the gradients are bf16).

Then the on-policy check of ``model.numerics = "invariant"`` (issue #41) on the same
device: a rollout of a tiny dense model (the ``tiny`` preset, 2 layers) by the ``compact``
engine, scored by one GRPO step's forward on the packed rollout
(``harness.on_policy``), in float32 and bf16 compute: the table says whether the sampler's
log-probs equal the trainer's bit for bit (``np.array_equal``; the exit status is 1 if not)
and the largest difference.

``--resources`` needs no GPU, only the ``triton`` package: it compiles every Triton kernel
(forward and the backward's ``du``) of the cases of ``harness/triton_compile.py`` to
an sm_90 cubin and prints registers per thread, shared memory per block and local memory
and stack (spills), as ``tests/jaxhead/test_triton_compile.py`` checks them; exit status 1
if a kernel spills or exceeds sm_90's 227 KiB of shared memory per block.

On one H200 the full run should take about a minute of compute plus compiles (the
script prints its own elapsed time; the budget is 8 minutes).
"""

from __future__ import annotations

import argparse
import sys
import time

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

import jaxhead

FULL = {"n": 16384, "hidden": 4096, "vocab": 151936, "iters": 5, "matmul": 8192}
DRY = {"n": 64, "hidden": 64, "vocab": 500, "iters": 1, "matmul": 128}
IMPLS = ("reference", "xla", "pallas_triton")


def _inputs(n: int, hidden: int, vocab: int):
    k = jax.random.split(jax.random.key(0), 5)
    h = jax.random.normal(k[0], (n, hidden), jnp.float32).astype(jnp.bfloat16)
    w = (jax.random.normal(k[1], (hidden, vocab), jnp.float32) * (2.0 / hidden**0.5)).astype(
        jnp.bfloat16
    )
    labels = jax.random.randint(k[2], (n,), 0, vocab)
    temp = jax.random.uniform(k[3], (n,), jnp.float32, 0.7, 1.3)
    adv = jax.random.normal(k[4], (n,), jnp.float32)
    return h, w, labels, temp, adv


def _step(impl: str, labels, temp, adv, blocks):
    """jitted ``(h, w) -> ((loss, (logp, ent)), (dh, dw))`` for ``impl``."""

    def loss(h, w):
        if impl == "reference":
            out = jaxhead.reference_token_logprobs(h, w, labels, temperature=temp)
        else:
            kw = {"config": blocks} if impl == "pallas_triton" else {}
            out = jaxhead.token_logprobs(h, w, labels, temperature=temp, impl=impl, **kw)
        value = jnp.mean(adv * out.logprobs) + 0.01 * jnp.mean(out.entropy)
        return value, (out.logprobs, out.entropy)

    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))


def _peak_bytes(compiled) -> int:
    m = compiled.memory_analysis()
    peak = getattr(m, "peak_memory_in_bytes", 0)
    if peak:
        return int(peak)
    return int(
        m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )


def _time(fn, *args, iters: int) -> tuple[float, object]:
    from harness import bench

    t = bench.rounds({"call": lambda: fn(*args)}, iters)["call"]  # after one warm-up
    return t.wall, t.last


def matmul_rate(size: int, iters: int) -> float:
    """Measured bf16 ``size^3`` matmul rate, FLOP/s."""
    k = jax.random.split(jax.random.key(1), 2)
    a = jax.random.normal(k[0], (size, size), jnp.bfloat16)
    b = jax.random.normal(k[1], (size, size), jnp.bfloat16)
    f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
    seconds, _ = _time(f, a, b, iters=max(iters, 3))
    return 2 * size**3 / seconds


def _max_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def run(n: int, hidden: int, vocab: int, iters: int, matmul: int, blocks=None) -> list[dict]:
    """Rows of the table (one per implementation); ``blocks``: a
    ``jaxhead.PallasTritonConfig`` (None: the kernel's defaults)."""
    h, w, labels, temp, adv = _inputs(n, hidden, vocab)
    peak_rate = matmul_rate(matmul, iters)
    useful = 6 * n * hidden * vocab
    rows, outs = [], {}
    for impl in IMPLS:
        row = {"impl": impl, "matmul_tflops": peak_rate / 1e12}
        rows.append(row)
        try:
            step = _step(impl, labels, temp, adv, blocks)
            t0 = time.perf_counter()
            compiled = step.lower(h, w).compile()
            row["compile_s"] = time.perf_counter() - t0
            seconds, out = _time(compiled, h, w, iters=iters)
        except Exception as err:  # noqa: BLE001 - report it in the table, keep the other rows
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            continue
        (_, (logp, ent)), (dh, dw) = out
        outs[impl] = (logp, ent, dh, dw)
        row.update(
            ms=1e3 * seconds, tflops=useful / seconds / 1e12,
            peak_share=useful / seconds / peak_rate, peak_gib=_peak_bytes(compiled) / 2**30,
            finite=all(bool(jnp.all(jnp.isfinite(x))) for x in outs[impl]),
        )
    base = outs.get("xla")
    for row in rows:
        diffs = [np.nan] * 4
        if base is not None and row["impl"] in outs:
            diffs = [_max_diff(a, b) for a, b in zip(outs[row["impl"]], base)]
        row.update(zip(("d_logp", "d_ent", "d_dh", "d_dw"), diffs))
    return rows


def format_table(rows: list[dict]) -> str:
    header = (
        f"{'impl':<14}{'ms/step':>10}{'TFLOP/s':>10}{'%matmul':>9}{'peak_GiB':>10}"
        f"{'compile_s':>11}{'|dlogp|':>10}{'|dent|':>10}{'|ddh|':>10}{'|ddW|':>10}{'finite':>8}"
    )
    lines = [header, "-" * len(header)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['impl']:<14}FAILED {r['error']}")
            continue
        lines.append(
            f"{r['impl']:<14}{r['ms']:>10.2f}{r['tflops']:>10.2f}{100 * r['peak_share']:>8.1f}%"
            f"{r['peak_gib']:>10.3f}{r['compile_s']:>11.1f}{r['d_logp']:>10.2e}"
            f"{r['d_ent']:>10.2e}{r['d_dh']:>10.2e}{r['d_dw']:>10.2e}{r['finite']!s:>8}"
        )
    return "\n".join(lines)


#: The on-policy check's workload (``harness.on_policy.workload``): full run and dry run.
ON_POLICY = {"prompts": 8, "group": 4, "new_tokens": 24, "row_len": 128}
ON_POLICY_DRY = {"prompts": 2, "group": 2, "new_tokens": 4, "row_len": 64}


def on_policy_rows(dtypes, sizes: dict) -> list[dict]:
    """Per dtype: the sampler's vs the trainer's log-probs under ``numerics="invariant"``
    (``harness.on_policy.gap``: ``equal``, ``max``, ``tokens``), or ``error``."""
    from harness import on_policy

    rows = []
    for dtype in dtypes:
        try:
            work = on_policy.workload("tiny", numerics="invariant", dtype=dtype, **sizes)
            rows.append({"dtype": dtype, **on_policy.gap(work)})
        except Exception as err:  # noqa: BLE001 - report it in the table
            rows.append({"dtype": dtype,
                         "error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"})
    return rows


def format_on_policy(rows: list[dict]) -> str:
    lines = ["numerics=invariant, tiny dense model: sampler log-probs vs the GRPO step's",
             f"{'dtype':<10}{'tokens':>8}{'max|diff|':>12}{'bit_equal':>11}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['dtype']:<10}FAILED {r['error']}")
        else:
            lines.append(f"{r['dtype']:<10}{r['tokens']:>8}{r['max']:>12.3g}"
                         f"{r['equal']!s:>11}")
    return "\n".join(lines)


def print_resources() -> int:
    """The ``--resources`` table; 2 without ``triton``, 1 if a kernel spills."""
    try:
        import triton
    except ImportError:
        print("--resources needs the triton package (pip install triton)", file=sys.stderr)
        return 2
    from harness import triton_compile as trc

    print(f"jaxhead gpu_check --resources: Triton {triton.__version__} -> sm_90 cubin, "
          f"jax {jax.__version__}")
    print("| case | kernel | warps | stages | registers | shared KiB | local + stack B |\n"
          "|---|---|---|---|---|---|---|")
    ok = True
    for case in trc.CASES:
        for used in trc.case_resources(case):
            ok &= used.local + used.stack == 0 and used.shared <= trc.SM90_SHARED_LIMIT
            print(f"| {case.name} | {used.kernel} | {used.num_warps} | {used.num_stages} | "
                  f"{used.registers} | {used.shared / 1024:.1f} | {used.local + used.stack} |",
                  flush=True)
    return 0 if ok else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="CPU, Pallas interpret mode, tiny sizes")
    parser.add_argument("--n", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--iters", type=int)
    parser.add_argument("--triton-blocks", metavar="T,C,K,WARPS,STAGES",
                        help="Triton tiles to try instead of the defaults, e.g. 128,128,64,8,3")
    parser.add_argument("--resources", action="store_true",
                        help="no GPU: registers, shared memory and spills of each kernel")
    args = parser.parse_args(argv)
    if args.resources:
        return print_resources()
    sizes = dict(DRY if args.dry_run else FULL)
    for key in ("n", "hidden", "vocab", "iters"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    if not args.dry_run and jax.default_backend() != "gpu":
        print(f"needs a GPU (default backend: {jax.default_backend()}); try --dry-run",
              file=sys.stderr)
        return 2
    blocks = None
    if args.triton_blocks:
        t, c, k, warps, stages = (int(x) for x in args.triton_blocks.split(","))
        blocks = jaxhead.PallasTritonConfig(t, c, k, num_warps=warps, num_stages=stages)
    t0 = time.perf_counter()
    mode = "interpret" if args.dry_run else None
    with jaxhead.pallas_interpret(mode):
        rows = run(**sizes, blocks=blocks)
    device = jax.devices()[0]
    print(f"jaxhead gpu_check: {device.device_kind} ({jax.default_backend()}), jax "
          f"{jax.__version__}, N={sizes['n']} H={sizes['hidden']} V={sizes['vocab']} bf16, "
          f"{'dry run (interpret mode)' if args.dry_run else 'compiled'}")
    print(f"measured bf16 matmul rate: {rows[0]['matmul_tflops']:.2f} TFLOP/s "
          f"({sizes['matmul']}^3); useful FLOPs per step 6NHV = "
          f"{6 * sizes['n'] * sizes['hidden'] * sizes['vocab'] / 1e12:.3f} TFLOP; "
          f"differences are max |impl - xla|")
    print(format_table(rows))
    checks = on_policy_rows(("bfloat16",) if args.dry_run else ("float32", "bfloat16"),
                            ON_POLICY_DRY if args.dry_run else ON_POLICY)
    print(format_on_policy(checks))
    print(f"elapsed {time.perf_counter() - t0:.1f} s")
    ok = all("error" not in r and r["finite"] for r in rows)
    return 0 if ok and all(r.get("equal") for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
