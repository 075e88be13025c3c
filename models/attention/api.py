"""Which attention implementation runs a call: the ``ModelConfig.attention_impl`` switch.

Implementations (``REGISTRY``, in ``"auto"``'s order):

* ``"xla_chunked"``: blockwise attention in XLA with an online softmax and a recomputing
  backward (``xla.py``, ``chunked_attention``); any backend, memory linear in the
  length. The portable default and the fallback.
* ``"splash"``: JAX's TPU splash attention kernel (``pallas_tpu.py``).
* ``"pallas_gpu"``: JAX's Pallas GPU (Triton) FlashAttention kernel (``pallas_gpu.py``).
  Chosen on GPU over ``jax.nn.dot_product_attention(implementation="cudnn")`` because in
  this JAX (0.10) that function takes padding only as per-row ``query_seq_lengths`` /
  ``key_value_seq_lengths`` and anything else as a dense ``[B, N, T, S]`` mask or bias,
  so packed segments would bring back the quadratic buffer; the Pallas kernel takes
  ``segment_ids`` directly.
* ``"invariant"``: blocks of keys at fixed absolute positions, queries in fixed tiles
  (``invariant.py``): a query's result does not depend on the batch or the call it is in
  (``ModelConfig.numerics = "invariant"``, which needs it; never picked by ``"auto"``).
* ``"dense"``: the materialised ``[B, T, S]`` mask and scores
  (``reference.py``, ``dense_attention``): the test reference.

Each is a ``jaxhead.dispatch.Entry`` called as ``call(plan, q, k, v, positions,
segment_ids, scale)``; a kernel's check refuses a context axis and checks the packing,
its probe traces and lowers it (``_lowering_error``).

``"auto"`` (``jaxhead.dispatch.Registry.resolve``) picks by the platform the trace
compiles for (``jaxhead.dispatch.target_platform``: the devices of the mesh in context,
``jax.set_mesh``, else ``jax.default_backend()``; so a CPU machine compiling for a TPU
topology picks what a TPU would): ``splash`` on TPU, ``pallas_gpu`` on GPU, ``xla_chunked``
elsewhere. It falls back to ``xla_chunked`` when the kernel cannot run the call (a length
that is not a multiple of its block, rows or heads that do not split over the mesh) or its
forward and backward do not lower for the platform (``jaxhead.dispatch.lowering_error``),
logging a warning on logger ``"jaxhead"`` (under ``jaxhead.dispatch.strict``: an error).
Any other error of a kernel raises. An explicit kernel raises
``jaxhead.KernelUnsupported`` instead; off its platform it runs in Pallas interpret mode
(slow: for tests).

Under a mesh with a ``context`` axis (``models.context``) the tokens of a row are split
and reordered: ``xla_chunked`` gathers each layer's keys and values over that axis
(``models.context.context_attention``) and the kernels, whose causal mask is by index,
are refused (``"auto"`` falls back).

Under a multi-device mesh a compiled kernel cannot be split by XLA's partitioner (Mosaic
and Triton calls are opaque to it), so it runs inside ``jax.shard_map``: rows split over
the batch axes present (``models.mesh.BATCH_AXES``), heads over ``tensor``; attention is
per row and per head, so each device runs the kernel on its own rows and heads, with no
communication.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxhead import dispatch
from jaxhead.dispatch import KernelUnsupported
from models.attention import invariant_mesh
from models.attention.base import check_packing
from models.attention.context import context_attention
from models.attention.pallas_gpu import pallas_gpu_attention
from models.attention.pallas_tpu import splash_attention
from models.attention.reference import dense_attention
from models.attention.xla import chunked_attention
from models.context import context_size
from models.mesh import BATCH_AXES, free_axes


@dataclasses.dataclass(frozen=True)
class Query:
    """What a check and a probe see of a ``self_attention`` call: the shapes and dtypes
    (``(shape, dtype)`` of ``q``, ``k``, ``v``, ``segment_ids``), the concrete positions
    and segment ids when they are (the kernels' packing precondition), the scale and the
    abstract mesh in context."""

    shapes: tuple
    positions: jax.Array
    segment_ids: jax.Array
    scale: float
    mesh: jax.sharding.AbstractMesh


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """A kernel entry's plan: the kernel function, run in Pallas interpret mode or not."""

    kernel: Callable
    interpret: bool


def _kernel_entry(name: str, kernel: Callable, platform: str) -> dispatch.Entry:
    """A fused kernel (masking causally by index) that compiles for ``platform`` and runs
    in interpret mode elsewhere (an explicit name off its platform: tests)."""
    def check(query: Query) -> KernelPlan:
        context = context_size(query.mesh)
        if context > 1:
            raise KernelUnsupported(
                f"{name} masks causally by token index; under context parallelism "
                f"(context={context}) a row's tokens are reordered for load balance")
        check_packing(query.positions, query.segment_ids)
        return KernelPlan(kernel, dispatch.target_platform() != platform)

    def probe(plan: KernelPlan, query: Query) -> str | None:
        return _lowering_error(kernel, query.scale, plan.interpret, platform, query.shapes,
                               query.mesh)

    return dispatch.Entry(name, _run_kernel, (platform,), check=check, probe=probe)


def _run_kernel(plan: KernelPlan, q, k, v, positions, segment_ids, scale):
    return _per_device(plan.kernel, q, k, v, segment_ids, scale=scale,
                       interpret=plan.interpret)


def _xla_chunked(plan, q, k, v, positions, segment_ids, scale):
    if context_size(jax.sharding.get_abstract_mesh()) > 1:
        return context_attention(q, k, v, positions, segment_ids, scale=scale)
    return chunked_attention(q, k, v, positions, segment_ids, positions, segment_ids,
                             scale=scale)


def _invariant(plan, q, k, v, positions, segment_ids, scale):
    return invariant_mesh.self_attention(q, k, v, positions, segment_ids, scale=scale)


def _dense(plan, q, k, v, positions, segment_ids, scale):
    return dense_attention(q, k, v, positions, segment_ids, positions, segment_ids,
                           scale=scale)


#: ``ModelConfig.attention_impl`` values, in ``"auto"``'s order; each called as
#: ``call(plan, q, k, v, positions, segment_ids, scale)``.
REGISTRY: dispatch.Registry[Callable] = dispatch.Registry("attention_impl", [
    _kernel_entry("splash", splash_attention, "tpu"),
    _kernel_entry("pallas_gpu", pallas_gpu_attention, "gpu"),
    dispatch.Entry("xla_chunked", _xla_chunked),
    dispatch.Entry("invariant", _invariant, auto=False),
    dispatch.Entry("dense", _dense, auto=False),
])
IMPLEMENTATIONS = REGISTRY.names


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                   segment_ids: jax.Array, *, scale: float, impl: str = "auto") -> jax.Array:
    """Causal grouped-query attention of packed rows (training and scoring).

    A query reads the keys of its own non-zero segment whose position is <= its own.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, T, K, D]`` (``N % K == 0``); compute dtype.
      positions, segment_ids: int ``[B, T]``; segment id 0 is padding. The kernels also
        need positions increasing with the index within each segment
        (``models.attention.base.check_packing``, checked when concrete).
      scale: logit scale (``D ** -0.5``).
      impl: ``"auto"`` or one of ``IMPLEMENTATIONS`` (``jaxhead.dispatch.Registry.
        resolve``; under ``jaxhead.dispatch.strict`` a fallback raises).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``. Padding rows hold finite values that differ
      between implementations (no loss reads them).

    Raises:
      ValueError: unknown ``impl``; positions that break the kernels' precondition.
      KernelUnsupported: an explicitly requested kernel cannot run these shapes.
    """
    shapes = tuple((x.shape, jnp.dtype(x.dtype)) for x in (q, k, v, segment_ids))
    query = Query(shapes, positions, segment_ids, scale, jax.sharding.get_abstract_mesh())
    return REGISTRY.resolve(impl, query)(q, k, v, positions, segment_ids, scale)


@functools.lru_cache(maxsize=128)
def _lowering_error(kernel, scale: float, interpret: bool, platform: str, shapes: tuple,
                    mesh) -> str | None:
    """``dispatch.lowering_error`` of the kernel's forward and backward (``jax.grad`` of
    the output's float32 sum w.r.t. ``q``, ``k``, ``v``; ``_per_device`` under ``mesh``,
    the abstract mesh in context) on abstract inputs of ``shapes`` (``(shape, dtype)`` of
    ``q``, ``k``, ``v``, ``segment_ids``). Cached per call shape and mesh: every layer of
    an unrolled stack and every retrace asks the same question.

    Raises:
      KernelUnsupported: the kernel refuses the shapes (while tracing, before lowering;
        not cached). Any other error tracing it propagates too.
    """
    run = functools.partial(_per_device, kernel, scale=scale, interpret=interpret)

    def loss(q, k, v, segment_ids):
        return jnp.sum(run(q, k, v, segment_ids).astype(jnp.float32))

    args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
    with jax.sharding.use_abstract_mesh(mesh):
        return dispatch.lowering_error(jax.grad(loss, (0, 1, 2)), *args, platform=platform)


def _per_device(kernel, q, k, v, segment_ids, **kwargs):
    """``kernel(q, k, v, segment_ids, **kwargs)``, inside ``jax.shard_map`` over the mesh in
    context when XLA would otherwise have to partition it (rows over the batch axes, heads
    over ``tensor``; see the module docstring). The shard_map is manual over every axis
    not already manual, size-1 ones included: Mosaic refuses a partly manual context.

    Raises:
      KernelUnsupported: the rows or the KV heads do not split over those axes.
    """
    mesh = jax.sharding.get_abstract_mesh()
    free = free_axes(mesh)
    auto = {name: size for name, size in free.items() if size > 1}
    if not auto:
        return kernel(q, k, v, segment_ids, **kwargs)
    rows = tuple(a for a in BATCH_AXES if a in auto) or None
    heads = "tensor" if "tensor" in auto else None
    row_shards = 1 if rows is None else math.prod(auto[a] for a in rows)
    head_shards = auto.get("tensor", 1)
    unsplit = [a for a in auto if a not in (*(rows or ()), heads)]
    if q.shape[0] % row_shards or k.shape[2] % head_shards or unsplit:
        raise KernelUnsupported(
            f"rows ({q.shape[0]}) and KV heads ({k.shape[2]}) must split over the mesh "
            f"axes {dict(auto)} (rows over {rows}, heads over {heads}; no other axes)")
    heads_spec, rows_spec = P(rows, None, heads, None), P(rows, None)
    run = jax.shard_map(lambda *a: kernel(*a, **kwargs), mesh=mesh,
                        in_specs=(heads_spec, heads_spec, heads_spec, rows_spec),
                        out_specs=heads_spec, axis_names=set(free), check_vma=False)
    return run(q, k, v, segment_ids)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array,
                    segment_ids: jax.Array, kv_positions: jax.Array,
                    kv_segment_ids: jax.Array, *, scale: float, impl: str = "auto"
                    ) -> jax.Array:
    """Attention of T new tokens over the whole KV cache (prefill and decode).

    A one-token decode step (``T = 1``) uses the dense path: its scores are ``[B, N, 1,
    L]``, linear in the cache length, and one matmul pair beats the blockwise loop
    (docs/benchmarks.md, "Decode attention"). Prefill (``T > 1``) uses
    ``xla_chunked``, or ``dense`` when ``impl="dense"``; ``impl="invariant"`` serves both
    (``models.attention.invariant.cache_attention``: one sequence per row). The kernels
    never serve the cache:
    their causal mask counts from index 0 of a static length, while the new tokens sit at
    the traced slot ``cache.index``.

    Args:
      q: ``[B, T, N, D]``; k, v: ``[B, L, K, D]`` (the whole cache, new tokens written).
      positions, segment_ids: int ``[B, T]`` of the new tokens.
      kv_positions, kv_segment_ids: int ``[B, L]`` of every slot (0: empty or padding).
      scale, impl: as ``self_attention`` (``impl`` validated).

    Returns:
      ``[B, T, N, D]`` in the dtype of ``v``.

    Raises:
      ValueError: unknown ``impl``.
    """
    REGISTRY.check_name(impl)
    args = (q, k, v, positions, segment_ids, kv_positions, kv_segment_ids)
    if impl == "invariant":
        return invariant_mesh.cache_attention(*args, scale=scale)
    if impl == "dense" or q.shape[1] == 1:
        return dense_attention(*args, scale=scale)
    return chunked_attention(*args, scale=scale)
