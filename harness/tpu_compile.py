"""Compile the head for TPU slices with the real TPU compiler, on a machine without a TPU.

Shared by ``tests/jaxhead/test_tpu_compile.py`` and ``benchmarks/tpu_compile.py``. Needs
``libtpu`` (``pip install -e '.[tpu]'``), not a TPU:
``jax.experimental.topologies.get_topology_desc`` gives the devices of a slice, and a
program jitted under ``jax.set_mesh`` of a mesh of them lowers and ``.compile()``s with the
TPU compiler (Mosaic kernels for real; per-device HBM from ``memory_analysis()``).

Every case is ``jax.grad`` of ``sum(logp) + sum(entropy)`` (forward and backward) of one
head configuration (``Case``) in one mode:

* ``plain``: ``jaxhead.token_logprobs`` on one chip (a 1-device mesh);
* ``sharded``: ``jaxhead.sharded_token_logprobs`` with the tokens split over 4 chips;
* ``vocab``: the vocab-parallel head (``vocab_axis=``), tokens over 2 chips x vocabulary
  over 2 (an XLA implementation: the kernels have no vocab-parallel variant).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxhead
from jaxhead._src.head import pallas_mode, pallas_tpu
from jaxhead._src.head.base import HeadSpec

# libtpu takes a machine-wide lock (/tmp/libtpu_lockfile) when it loads: without this a second
# process (a pytest-xdist worker, a benchmark) fails "Internal error when accessing libtpu
# multi-process lockfile". Compiling for a topology touches no TPU, so sharing is safe.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

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
    weight_layout: str = "hv"  # "vh": the weight [V, H], as a tied embedding table

    @property
    def shape(self) -> str:
        dtype = "bf16" if self.dtype == "bfloat16" else "f32"
        return f"{self.n}x{self.hidden}x{self.vocab} {dtype}"

    @property
    def label(self) -> str:
        """A test id: ``impl-mode-NxHxV-dtype-options``."""
        return "-".join([self.impl, self.mode, self.shape.replace(" ", "-"), self.options])

    @property
    def options(self) -> str:
        opts = ["cap"] * bool(self.softcap) + ["temp"] * self.token_temp
        opts += ["minl"] * self.min_logit + ["vh"] * (self.weight_layout == "vh")
        return "+".join(opts) or "-"


#: The shapes of issue 14 and Qwen3-30B-A3B's head (4096 tokens per chip).
SHAPES = {
    "qwen-8k": {"n": 8192, "hidden": 4096, "vocab": 151936, "dtype": "bfloat16"},
    "cap-temp": {"n": 2056, "hidden": 5120, "vocab": 152064, "dtype": "bfloat16", "softcap": SOFTCAP,
                     "token_temp": True},
    "f32-temp": {"n": 1024, "hidden": 2048, "vocab": 32000, "dtype": "float32", "token_temp": True},
    "qwen3-30b": {"n": 4096, "hidden": 2048, "vocab": 151936, "dtype": "bfloat16", "token_temp": True,
                      "min_logit": True},
}


@functools.cache
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
    vh = case.weight_layout == "vh"
    w_spec = P("vocab", None) if vh else P(None, "vocab")
    w_sharding = NamedSharding(mesh, w_spec) if case.mode == "vocab" else rep
    w_shape = (case.vocab, case.hidden) if vh else (case.hidden, case.vocab)
    per_row = jax.ShapeDtypeStruct((case.n,), jnp.float32, sharding=tok)
    args = (
        jax.ShapeDtypeStruct((case.n, case.hidden), dtype, sharding=tok),
        jax.ShapeDtypeStruct(w_shape, dtype, sharding=w_sharding),
        jax.ShapeDtypeStruct((case.n,), jnp.int32, sharding=tok),
        per_row if case.token_temp else None,
        per_row if case.min_logit else None,
    )
    kw = {"softcap": case.softcap, "impl": case.impl, "config": case.config,
          "weight_layout": case.weight_layout}

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
                    truncated=case.min_logit, weight_layout=case.weight_layout)
    with pallas_mode.per_device(mesh):
        return pallas_tpu.make_plan(case.config, spec)


def compile_case(case: Case, devices) -> dict:
    """Compile ``case`` for ``devices``' generation: a table row (``error`` on failure)."""
    mesh = mesh_for(devices, case.mode)
    row = {"case": case}
    fn, args = step(case, mesh)
    t0 = time.perf_counter()
    try:
        with jax.set_mesh(mesh):
            lowered = fn.lower(*args)
            compiled = lowered.compile()
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
    # the compiled executable's text can fail to print (async ops); the lowered one names
    # every Mosaic kernel as a tpu_custom_call
    row["kernels"] = lowered.as_text().count("@tpu_custom_call")
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
            jax.ShapeDtypeStruct(plan.spec.local_weight_shape, dtype),
            jax.ShapeDtypeStruct((padded,), jnp.int32), vec, vec)
    kernels = (
        (lambda p: lambda *a: pallas_tpu.forward(p, *a), args),
        (lambda p: lambda *a: pallas_tpu.backward(p, *a)[0], args + (vec,) * 5),
        (lambda p: lambda *a: pallas_tpu.backward(p, *a)[1], args + (vec,) * 5),
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
            except Exception as err:
                found = _SIZE.search(str(err))
                if found is None:
                    raise
                size = float(found.group(1)) * units[found.group(2)]
                limit = max(int(size) + 1, limit + 2**16)
        out.append(limit / MIB)
    return tuple(out)
