"""Compile the Pallas Triton kernels of the head to sm_90 cubins on a machine without a GPU,
and read their resource usage (registers, shared memory, local memory = spills).

Shared by ``tests/jaxhead/test_triton_compile.py`` and ``benchmarks/gpu_check.py
--resources``. Needs the ``triton`` package (it brings its own ``ptxas`` and ``cuobjdump``),
not a GPU or CUDA:

1. ``jax.grad`` of ``sum(logp) + sum(entropy)`` with ``impl="pallas_triton"`` is lowered for
   ``cuda`` on CPU (``lower(lowering_platforms=("cuda",))``, planned for a GPU inside
   ``jaxhead.dispatch.compile_for("gpu")``); each kernel is a ``__gpu$xla.gpu.triton`` custom
   call whose ``mhlo.backend_config`` holds its Triton IR (``ir``, MLIR bytecode), name,
   ``num_warps`` and ``num_stages``: the forward (``jaxhead_head_forward``) and the
   backward's ``du`` kernel (``jaxhead_head_dlogits``).
2. The bytecode is printed as text with jax's own Triton dialect (jaxlib's MLIR and
   ``triton``'s differ, their bytecode is not interchangeable) and ``triton.compile``
   compiles that TTIR for ``GPUTarget("cuda", 90, 32)``: the same passes and ``ptxas``.
3. ``cuobjdump -res-usage`` on the cubin gives registers per thread, static shared memory,
   stack and local memory; Triton's metadata gives the dynamic shared memory.

Uses jax internals (``jax._src.interpreters.mlir``, ``jax._src.lib.triton``): test and
benchmark support only. Compiles are cached by Triton (``~/.triton/cache``).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp

import jaxhead
from jaxhead import dispatch

#: Shared memory an sm_90 block may use (H100 / H200: 227 KiB of the SM's 228).
SM90_SHARED_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class TritonCase:
    """One head configuration: ``n`` tokens, ``hidden`` x ``vocab`` weight."""

    name: str
    n: int
    hidden: int
    vocab: int
    dtype: str
    softcap: float | None = None
    token_temp: bool = False
    weight_layout: str = "hv"  # "vh": the weight [V, H], as a tied embedding table


#: bf16 Qwen vocabulary (also as a ``[V, H]`` tied table); soft-cap + per-token temperature
#: with a ragged vocabulary (no power-of-two tile divides 151665, Qwen2.5's real token
#: count); float32.
CASES = (
    TritonCase("qwen-bf16", 4096, 4096, 151936, "bfloat16"),
    TritonCase("qwen-bf16-vh", 4096, 4096, 151936, "bfloat16", weight_layout="vh"),
    TritonCase("cap-temp-ragged", 2056, 5120, 151665, "bfloat16", softcap=30.0,
               token_temp=True),
    TritonCase("f32-temp", 1024, 2048, 32000, "float32", token_temp=True),
)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One Triton kernel as lowered: its TTIR (MLIR bytecode) and launch parameters."""

    name: str
    ir: bytes
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one compiled kernel uses per block (bytes) and per thread (registers)."""

    kernel: str
    registers: int
    shared: int  # static + dynamic shared memory
    local: int  # local memory (spills)
    stack: int
    num_warps: int
    num_stages: int


def lowered_kernels(case: TritonCase) -> list[Kernel]:
    """The distinct Triton kernels of ``case``'s forward and backward, lowered for cuda on
    CPU, in program order (the forward, then the backward's ``du`` kernel: one per distinct
    chunk width, e.g. a narrower last chunk)."""
    dtype = jnp.dtype(case.dtype)
    vec = jax.ShapeDtypeStruct((case.n,), jnp.float32)
    args = (jax.ShapeDtypeStruct((case.n, case.hidden), dtype),
            jax.ShapeDtypeStruct((case.vocab, case.hidden) if case.weight_layout == "vh"
                                 else (case.hidden, case.vocab), dtype),
            jax.ShapeDtypeStruct((case.n,), jnp.int32), vec)

    def loss(h, w, labels, temp):
        out = jaxhead.token_logprobs(h, w, labels, temperature=temp if case.token_temp else 1.0,
                                     softcap=case.softcap, impl="pallas_triton",
                                     weight_layout=case.weight_layout)
        return jnp.sum(out.logprobs) + jnp.sum(out.entropy)

    with dispatch.compile_for("gpu"):
        lowered = jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower(
            lowering_platforms=("cuda",))
    unique = {}  # the backward calls its du kernel once per vocab chunk: compile each once
    for kernel in _triton_calls(lowered.compiler_ir("stablehlo")):
        unique.setdefault((kernel.name, kernel.ir, kernel.num_warps, kernel.num_stages), kernel)
    return list(unique.values())


def _triton_calls(module) -> list[Kernel]:
    from jax._src.lib.mlir import ir

    found = []

    def visit(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    _maybe_kernel(child, ir, found)
                    visit(child.operation)

    visit(module.operation)
    return found


def _maybe_kernel(op, ir, found: list[Kernel]) -> None:
    if op.operation.name != "stablehlo.custom_call":
        return
    if "triton" not in ir.StringAttr(op.attributes["call_target_name"]).value:
        return
    config = ir.DictAttr(op.attributes["mhlo.backend_config"])
    attrs = {config[i].name: config[i].attr for i in range(len(config))}
    num = {k: ir.IntegerAttr(attrs[k]).value
           for k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
    found.append(Kernel(ir.StringAttr(attrs["name"]).value,
                        ir.StringAttr(attrs["ir"]).value_bytes, num["num_warps"], num["num_stages"],
                        (num["grid_x"], num["grid_y"], num["grid_z"])))


def ttir_text(kernel: Kernel) -> str:
    """The kernel's TTIR as text, printed by jax's MLIR with its Triton dialect."""
    from jax._src.interpreters import mlir
    from jax._src.lib import triton as jax_triton
    from jax._src.lib.mlir import ir

    context = mlir.make_ir_context()
    jax_triton.dialect.register_dialect(context)
    with context:
        return str(ir.Module.parse(kernel.ir))


def compile_cubin(kernel: Kernel, arch: int = 90):
    """``triton.compile`` of ``kernel`` for ``sm_<arch>``: the ``CompiledKernel``."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / f"{kernel.name}.ttir"
        path.write_text(ttir_text(kernel))
        return triton.compile(str(path), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": kernel.num_warps,
                                       "num_stages": kernel.num_stages,
                                       "enable_fp_fusion": True})  # Triton's default


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resources(kernel: Kernel, arch: int = 90) -> Resources:
    """Registers, shared memory and spills of ``kernel`` compiled for ``sm_<arch>``.

    Raises:
      RuntimeError: ``cuobjdump`` printed no resource line for the kernel.
    """
    from triton import knobs

    compiled = compile_cubin(kernel, arch)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        tool = knobs.nvidia.cuobjdump.path  # the one Triton ships (or $TRITON_CUOBJDUMP_PATH)
        out = subprocess.run([tool, "-res-usage", str(cubin)], capture_output=True,
                             text=True, check=True).stdout
    found = _USAGE.search(out)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no usage for {kernel.name}: {out}")
    regs, stack, static_shared, local = (int(x) for x in found.groups())
    return Resources(kernel.name, regs, static_shared + compiled.metadata.shared, local, stack,
                     kernel.num_warps, kernel.num_stages)


def case_resources(case: TritonCase, arch: int = 90) -> list[Resources]:
    """``resources`` of every kernel of ``case`` (forward, then the backward's ``du``)."""
    return [resources(k, arch) for k in lowered_kernels(case)]
