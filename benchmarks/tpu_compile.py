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
import dataclasses
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhead
from jaxhead._src.head import pallas_tpu
from jaxhead._src.head.base import HeadSpec

MIB = 2**20
#: Small slices of each generation that ``get_topology_desc`` accepts (>= 4 chips).
TOPOLOGIES = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
SOFTCAP = 30.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One head configuration: ``n`` tokens (global), ``hidden`` x ``vocab`` weight."""

    n: int
    hidden: int
    vocab: int
    dtype: str
    softcap: float | None = None
    token_temp: bool = False
    min_logit: bool = False
    impl: str = "pallas_tpu"
    mode: str = "plain"  # plain | sharded | vocab
    config: jaxhead.PallasTpuConfig | None = None

    @property
    def shape(self) -> str:
        return f"{self.n}x{self.hidden}x{self.vocab} {'bf16' if self.dtype == 'bfloat16' else 'f32'}"

    @property
    def options(self) -> str:
        opts = ["cap"] * bool(self.softcap) + ["temp"] * self.token_temp
        return "+".join(opts + ["minl"] * self.min_logit) or "-"


#: The shapes of issue 14 and Qwen3-30B-A3B's head (4096 tokens per chip).
SHAPES = {
    "qwen-8k": dict(n=8192, hidden=4096, vocab=151936, dtype="bfloat16"),
    "cap-temp": dict(n=2056, hidden=5120, vocab=152064, dtype="bfloat16", softcap=SOFTCAP,
                     token_temp=True),
    "f32-temp": dict(n=1024, hidden=2048, vocab=32000, dtype="float32", token_temp=True),
    "qwen3-30b": dict(n=4096, hidden=2048, vocab=151936, dtype="bfloat16", token_temp=True,
                      min_logit=True),
}


def topology_devices(generation: str):
    """The devices of ``TOPOLOGIES[generation]`` (needs libtpu, not a TPU)."""
    from jax.experimental import topologies

    name = TOPOLOGIES.get(generation, generation)
    return topologies.get_topology_desc(topology_name=name, platform="tpu").devices


def mesh_for(devices, mode: str) -> Mesh:
    """One chip (``plain``), 4 chips on ``data`` (``sharded``), or 2 x 2 ``data`` x
    ``vocab`` (``vocab``)."""
    if mode == "plain":
        return Mesh(np.array(devices[:1]), ("data",))
    if mode == "sharded":
        return Mesh(np.array(devices[:4]), ("data",))
    return Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "vocab"))


def step(case: Case, mesh: Mesh):
    """``(jitted grad of the head's sum(logp) + sum(entropy), abstract arguments)``."""
    dtype = jnp.dtype(case.dtype)
    tok = NamedSharding(mesh, P("data") if case.mode != "plain" else P())
    rep = NamedSharding(mesh, P())
    w_sharding = NamedSharding(mesh, P(None, "vocab")) if case.mode == "vocab" else rep
    per_row = jax.ShapeDtypeStruct((case.n,), jnp.float32, sharding=tok)
    args = (
        jax.ShapeDtypeStruct((case.n, case.hidden), dtype, sharding=tok),
        jax.ShapeDtypeStruct((case.hidden, case.vocab), dtype, sharding=w_sharding),
        jax.ShapeDtypeStruct((case.n,), jnp.int32, sharding=tok),
        per_row if case.token_temp else None,
        per_row if case.min_logit else None,
    )
    kw = dict(softcap=case.softcap, impl=case.impl, config=case.config)

    def loss(h, w, labels, temp, min_logit):
        temp = 1.0 if temp is None else temp
        if case.mode == "plain":
            out = jaxhead.token_logprobs(h, w, labels, temperature=temp, min_logit=min_logit,
                                         **kw)
        else:
            out = jaxhead.sharded_token_logprobs(
                h, w, labels, mesh=mesh, token_axes=("data",), temperature=temp,
                min_logit=min_logit, vocab_axis="vocab" if case.mode == "vocab" else None, **kw)
        return jnp.sum(out.logprobs) + jnp.sum(out.entropy)

    return jax.jit(jax.grad(loss, (0, 1))), args


def tpu_plan(case: Case, mesh: Mesh):
    """The ``pallas_tpu`` plan of one device's rows, made for ``mesh``'s generation."""
    rows = case.n // (4 if case.mode == "sharded" else 1)
    spec = HeadSpec(rows, case.hidden, case.vocab, case.dtype, case.softcap, True,
                    truncated=case.min_logit)
    with jax.set_mesh(mesh):
        return pallas_tpu.make_plan(case.config, spec)


def compile_case(case: Case, devices) -> dict:
    """Compile ``case`` for ``devices``' generation: a table row (``error`` on failure)."""
    mesh = mesh_for(devices, case.mode)
    row = {"case": case}
    fn, args = step(case, mesh)
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            compiled = fn.lower(*args).compile()
    except Exception as err:  # noqa: BLE001 - a row of the table, not a crash
        row["error"] = f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        row["compile_s"] = time.perf_counter() - t0
        return row
    row["compile_s"] = time.perf_counter() - t0
    mem = compiled.memory_analysis()
    row["args_mib"] = mem.argument_size_in_bytes / MIB
    row["temp_mib"] = mem.temp_size_in_bytes / MIB
    peak = getattr(mem, "peak_memory_in_bytes", 0) or (
        mem.argument_size_in_bytes + mem.output_size_in_bytes + mem.temp_size_in_bytes
        - mem.alias_size_in_bytes)
    row["peak_mib"] = peak / MIB
    row["kernels"] = compiled.as_text().count('custom_call_target="tpu_custom_call"')
    return row


_SIZE = re.compile(r"(?:Scoped allocation with size|Used) ([\d.]+)([KMG]?)")


def kernel_vmem(case: Case, devices) -> tuple[float, float, float]:
    """MiB of scoped VMEM each kernel (forward, ``dh``, ``dW``) of ``case``'s plan needs:
    the smallest ``vmem_limit_bytes`` it compiles under, found by recompiling it alone
    with the size the compiler reports until it fits (a few compiles per kernel)."""
    mesh = mesh_for(devices, "plain")
    plan, padded = tpu_plan(case, mesh)
    dtype = jnp.dtype(case.dtype)
    vec = jax.ShapeDtypeStruct((padded,), jnp.float32)
    args = (jax.ShapeDtypeStruct((padded, case.hidden), dtype),
            jax.ShapeDtypeStruct((case.hidden, case.vocab), dtype),
            jax.ShapeDtypeStruct((padded,), jnp.int32), vec, vec)
    kernels = (
        (lambda p: lambda *a: pallas_tpu._forward(p, *a), args),
        (lambda p: lambda *a: pallas_tpu._backward(p, *a)[0], args + (vec,) * 5),
        (lambda p: lambda *a: pallas_tpu._backward(p, *a)[1], args + (vec,) * 5),
    )
    units = {"": 1, "K": 2**10, "M": MIB, "G": 2**30}
    out = []
    for make, kargs in kernels:
        limit = MIB
        while True:
            run = make(dataclasses.replace(plan, vmem_limit_bytes=limit))
            try:
                with jax.set_mesh(mesh):
                    jax.jit(run).lower(*kargs).compile()
                break
            except Exception as err:  # noqa: BLE001 - the compiler's size is the answer
                found = _SIZE.search(str(err))
                if found is None:
                    raise
                size = float(found.group(1)) * units[found.group(2)]
                limit = max(int(size) + 1, limit + 2**16)
        out.append(limit / MIB)
    return tuple(out)


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
