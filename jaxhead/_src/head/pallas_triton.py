"""Fused LM head for GPUs through Pallas' Triton lowering: logits tiles stay in registers.

``impl="pallas_triton"``: the contract of every implementation (``jaxhead._src.head.base``)
and the tile math of ``jaxhead._src.head.math``, with its own settings
(``PallasTritonConfig``). Tiles: ``T`` tokens x ``C`` vocab columns, the hidden axis
stepped ``K`` at a time (``PallasTritonConfig.block_tokens``, ``block_vocab``,
``block_hidden``); ``nt = B / T``, ``nv = ceil(V / C)``.

forward kernel, grid ``(nt, S)``
  Program ``(i, s)`` owns token tile ``i`` and the ``s``-th of ``S`` contiguous ranges of
  vocab tiles. For each vocab tile it accumulates ``u = h w`` over ``H / K`` steps in a
  float32 ``[T, C]`` register tile (``[T, K]`` and ``[K, C]`` operand tiles pipelined
  through shared memory, ``num_stages`` deep), then folds it into per-row running
  ``m, r, t, label logit`` (float32 ``[T]`` registers). Outputs those four per range,
  float32 ``[S, B]``; XLA merges the ranges (``math.combine``). FLOPs
  ``2 B H V`` + ~10 ``B V``, ``B V`` exp (+ ``B V`` tanh with a soft-cap). Global-memory
  reads (``b`` bytes per element): all of ``w`` once per token tile, ``nt H V b`` (programs
  with consecutive ids walk the same vocab range in step, so most are L2 hits), and each
  ``[T, H]`` ``h`` panel once per vocab tile, ``nv B H b``; written ``16 S B``. Nothing of
  size ``B x V`` is ever written.

backward
  On a GPU the float32 ``[T, H]`` (``d hidden``) or ``[H, C]`` (``d W``) accumulator of a
  fused backward does not fit in registers or shared memory for ``H`` in the thousands;
  the alternatives are atomics into float32 copies of both gradients, or a second
  recompute per gradient. Instead the vocabulary is walked in chunks of ``Vc`` columns
  (``backward_vocab_chunk``): a Triton kernel (grid ``(nt, Vc / C)``, same tiles and
  registers as the forward) recomputes each logit tile and writes ``du`` for the chunk in
  the input dtype, ``[B, Vc]`` in HBM, then two cuBLAS matmuls by XLA accumulate
  ``d hidden += du w_c^T`` (float32 ``[B, H]``) and produce ``d W_c = h^T du`` (float32
  accumulation, cast to the weight dtype). One recompute: FLOPs ``2 B H V`` (kernel) +
  ``4 B H V`` (matmuls); extra HBM traffic ``3 B V b`` for ``du`` (written once, read
  twice), bounded temporaries ``B Vc b + B H 4 + H Vc 4`` bytes. The numbers are those of
  the XLA path (``du`` cast to the input dtype before both matmuls).

``B`` is a multiple of ``T`` (the padded row count of ``plan``); ``V`` need not be a multiple of ``C`` (loads past ``V`` are masked to 0,
those columns enter the statistics as ``-inf`` and get ``du = 0``; nothing is stored past
the chunk). float32 matmuls use IEEE float32 (``Precision.HIGHEST``), not TF32.

A ``[V, H]`` weight (``HeadSpec.weight_layout == "vh"``, a tied embedding table) is read in
``[C, K]`` tiles contracted on K (``jaxhead._src.head.layout``), its backward chunks are row
blocks ``w_c [Vc, H]`` and ``d W_c = du^T h`` is ``[Vc, H]``: no transposed copy. 16-bit
``"vh"`` calls default to ``C = 128`` (``default_config``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxhead._src.head import layout, pallas_mode
from jaxhead._src.head import math as hm
from jaxhead._src.head.base import HeadSpec, Implementation, differentiable
from jaxhead.dispatch import KernelUnsupported

SUPPORTED_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_MIN_BLOCK = 16  # smallest tl.dot operand side
_TARGET_PROGRAMS = 1024  # forward programs to aim for (several waves on 132 SMs)
_DU_CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class PallasTritonConfig:
    """Settings of the ``"pallas_triton"`` implementation (None: ``default_config``'s value
    for the dtype). Block sizes are powers of two >= 16.

    Attributes:
      block_tokens: rows ``T`` per tile.
      block_vocab: vocab columns ``C`` per tile.
      block_hidden: hidden step ``K`` of the matmul loop.
      num_warps, num_stages: Triton launch / software-pipelining parameters.
      vocab_splits: vocab ranges ``S`` per token tile in the forward; None: enough for
        ~1024 programs (at most ``nv``).
      backward_vocab_chunk: columns ``Vc`` per backward chunk (a multiple of
        ``block_vocab``); None: the most whose ``du`` ``[B, Vc]`` fits in 256 MiB.
    """

    block_tokens: int | None = None
    block_vocab: int | None = None
    block_hidden: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    vocab_splits: int | None = None
    backward_vocab_chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class TritonPlan:
    """The resolved static settings of one call (hashable: a ``custom_vjp`` static arg).

    Attributes:
      spec: the problem.
      blocks: a ``PallasTritonConfig`` with every field resolved.
      interpret: a ``pallas_mode`` mode (None: compile with Triton).
    """

    spec: HeadSpec
    blocks: PallasTritonConfig
    interpret: str | None


def default_config(dtype, softcap: bool = False,
                   weight_layout: str = "hv") -> PallasTritonConfig:
    """Starting tiles for H100 / H200 (sm_90, 228 KiB shared memory per SM).

    16-bit inputs: ``T=64, C=256, K=64``, 8 warps, 3 stages: a 64 KiB float32 logit tile
    (64 registers a thread over 256 threads), 3 x 40 KiB of staged operands, and
    ``2 T C H / (2 T H) = C`` = 256 FLOPs per byte of the ``h`` panel re-read for each vocab
    tile. With a soft-cap ``C=128``: the ``tanh`` of the tile needs the registers (at
    ``C=256`` the forward used all 255 and spilled on sm_90, Triton 3.9; ``C=128``: 145,
    ``tests/jaxhead/test_triton_compile.py``). A ``[V, H]`` weight (``weight_layout="vh"``,
    its ``[C, K]`` tiles contracted on K) also takes ``C=128``: at ``C=256`` its forward
    used 255 registers and 8 bytes of stack (a spill); at ``C=128``, 144. float32 (IEEE, no
    tensor-core fast path; meant for checks, not speed): ``T=64, C=128, K=32``, 8 warps, 2
    stages. Tune on the device; all are overridable.
    """
    if jnp.dtype(dtype).itemsize == 2:
        narrow = softcap or weight_layout == "vh"
        return PallasTritonConfig(64, 128 if narrow else 256, 64, num_warps=8, num_stages=3)
    return PallasTritonConfig(64, 128, 32, num_warps=8, num_stages=2)


def _pow2_at_least(n: int) -> int:
    return max(_MIN_BLOCK, 1 << max(0, n - 1).bit_length())


def _resolve(config: PallasTritonConfig | None, dtype, softcap: bool,
             weight_layout: str) -> PallasTritonConfig:
    """``config`` with its None fields from ``default_config(dtype, softcap,
    weight_layout)``, checked."""
    base = default_config(dtype, softcap, weight_layout)
    given = {} if config is None else {
        f.name: v for f in dataclasses.fields(config) if (v := getattr(config, f.name)) is not None}
    blocks = dataclasses.replace(base, **given)
    for name in ("block_tokens", "block_vocab", "block_hidden"):
        v = getattr(blocks, name)
        if v < _MIN_BLOCK or v & (v - 1):
            raise ValueError(
                f"PallasTritonConfig.{name} must be a power of two >= {_MIN_BLOCK}, got {v}")
    for name in ("num_warps", "num_stages", "vocab_splits"):
        v = getattr(blocks, name)
        if v is not None and v < 1:
            raise ValueError(f"PallasTritonConfig.{name} must be >= 1, got {v}")
    return blocks


def make_plan(config: PallasTritonConfig | None, spec: HeadSpec) -> tuple[TritonPlan, int]:
    """``(TritonPlan, padded rows)``: ``T``, ``C`` and ``K`` shrink to the smallest power of
    two (>= 16) covering the rows, ``V`` and ``H`` when those are smaller; the split count
    and the backward chunk are resolved.

    Raises:
      KernelUnsupported: not on a GPU and not interpreting, a dtype other than
        bf16 / f16 / float32, or a vocab-parallel call.
      ValueError: block sizes that are not powers of two >= 16, a backward chunk that is
        not a multiple of ``block_vocab``, or a non-positive split / warp / stage count.
    """
    mode = pallas_mode.interpret_mode()
    pallas_mode.check_runnable(mode, "gpu", "pallas_triton")
    dtype = jnp.dtype(spec.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise KernelUnsupported(f"pallas_triton supports bf16, f16 and float32, got {dtype}")
    if spec.vocab_axis is not None or spec.hidden_shards > 1:
        raise KernelUnsupported(f"pallas_triton has no vocab-parallel variant and no hidden-split "
                                f"one (vocab_axis={spec.vocab_axis!r}, hidden_axes="
                                f"{spec.hidden_axes}); it runs on XLA")
    blocks = _resolve(config, dtype, spec.softcap is not None, spec.weight_layout)
    t = min(blocks.block_tokens, _pow2_at_least(spec.rows))
    c = min(blocks.block_vocab, _pow2_at_least(spec.vocab_size))
    k = min(blocks.block_hidden, _pow2_at_least(spec.hidden_size))
    padded = math.ceil(spec.rows / t) * t
    nt, nv = max(1, padded // t), pl.cdiv(spec.vocab_size, c)
    splits = blocks.vocab_splits or math.ceil(_TARGET_PROGRAMS / nt)
    splits = pl.cdiv(nv, pl.cdiv(nv, min(splits, nv)))  # no empty range
    chunk = blocks.backward_vocab_chunk
    if chunk is None:
        chunk = max(1, _DU_CHUNK_BYTES // max(1, padded * dtype.itemsize * c)) * c
    elif chunk < c or chunk % c:
        raise ValueError(
            f"PallasTritonConfig.backward_vocab_chunk must be a positive multiple of "
            f"block_vocab={c}, got {chunk}")
    resolved = dataclasses.replace(
        blocks, block_tokens=t, block_vocab=c, block_hidden=k, vocab_splits=splits,
        backward_vocab_chunk=min(chunk, nv * c))
    return TritonPlan(spec, resolved, mode), padded


# ----------------------------------------------------------------------------- kernels


def _logits_tile(h_ref, w_ref, col0, hidden: int, width: int, plan: TritonPlan):
    """float32 ``u [T, C] = h_tile @ w_tile`` of vocab entries ``col0 ...`` (``w[:, col0:col0
    + C]``, or ``w[col0:col0 + C, :]`` contracted on H for ``"vh"``), loads masked past
    ``width`` / ``H``."""
    blocks, lay = plan.blocks, plan.spec.weight_layout
    c, k = blocks.block_vocab, blocks.block_hidden
    cols = col0 + jnp.arange(c)
    col_ok = (cols < width) if width % c else None

    def step(kk, acc):
        ks = pl.ds(kk * k, k)
        row_ok = None
        if hidden % k:
            row_ok = (kk * k + jnp.arange(k)) < hidden
        h_mask = None if row_ok is None else row_ok[None, :]
        if lay == "hv":  # [K, C] operand tile
            index = (ks, pl.ds(col0, c))
            w_mask = _outer(row_ok, col_ok)
        else:  # [C, K]
            index = (pl.ds(col0, c), ks)
            w_mask = _outer(col_ok, row_ok)
        h = plgpu.load(h_ref.at[:, ks], mask=h_mask, other=0.0 if h_mask is not None else None)
        w = plgpu.load(w_ref.at[index], mask=w_mask, other=0.0 if w_mask is not None else None)
        return acc + layout.logits(h, w, lay)

    acc = jnp.zeros((blocks.block_tokens, c), jnp.float32)
    return lax.fori_loop(0, pl.cdiv(hidden, k), step, acc), cols


def _outer(rows_ok, cols_ok):
    """The 2-D load mask of a row mask and a column mask (either None: all in)."""
    if rows_ok is None:
        return None if cols_ok is None else cols_ok[None, :]
    return rows_ok[:, None] if cols_ok is None else rows_ok[:, None] & cols_ok[None, :]


def _masks(cols, width: int, block_vocab: int, y):
    """``(valid [1, C] or None, hit [T, C])``; ``y`` is ``[T, 1]`` relative to ``cols``."""
    valid = None if width % block_vocab == 0 else (cols < width)[None, :]
    return valid, cols[None, :] == y


def _forward_kernel(h_ref, w_ref, y_ref, inv_temperature_ref, *refs, plan: TritonPlan,
                    hidden: int, vocab: int, tiles_per_split: int):
    blocks, spec = plan.blocks, plan.spec
    ml = refs[0][...][:, None] if spec.truncated else None
    out_refs = refs[1:] if spec.truncated else refs
    c = blocks.block_vocab
    y = y_ref[...][:, None]
    inv_temperature = inv_temperature_ref[...][:, None]
    first = pl.program_id(1) * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, pl.cdiv(vocab, c))

    def body(j, stats):
        u, cols = _logits_tile(h_ref, w_ref, j * c, hidden, vocab, plan)
        z, _ = hm.logits(u, spec.softcap)
        valid, hit = _masks(cols, vocab, c, y)
        valid = hm.support(z, inv_temperature, ml, hit, valid)
        return hm.update(hm.Stats(*stats), z, inv_temperature, valid, hit, spec.with_entropy)

    stats = lax.fori_loop(first, last, body, hm.init_stats((blocks.block_tokens, 1)))
    for ref, value in zip(out_refs, stats, strict=True):
        ref[...] = value.reshape(blocks.block_tokens)


def _du_kernel(h_ref, w_ref, y_ref, *refs, plan: TritonPlan, hidden: int, width: int):
    *row_refs, du_ref = refs
    blocks = plan.blocks
    c = blocks.block_vocab
    y = y_ref[...][:, None]
    # inv_temperature, [min_logit], m, log_s, ent, g, e
    inv_temperature, *rest = (r[...][:, None] for r in row_refs)
    ml = rest.pop(0) if plan.spec.truncated else None
    u, cols = _logits_tile(h_ref, w_ref, pl.program_id(1) * c, hidden, width, plan)
    z, th = hm.logits(u, plan.spec.softcap)
    valid, hit = _masks(cols, width, c, y)
    valid = hm.support(z, inv_temperature, ml, hit, valid)
    du = hm.dlogits(z, th, inv_temperature, *rest, valid, hit, plan.spec.with_entropy)
    du_ref[...] = du.astype(du_ref.dtype)


# ----------------------------------------------------------------------------- calls


def _params(plan: TritonPlan):
    return {
        "compiler_params": plgpu.CompilerParams(
            num_warps=plan.blocks.num_warps, num_stages=plan.blocks.num_stages
        ),
        "interpret": plan.interpret is not None,
    }


def _vocab_dim(plan: TritonPlan) -> int:
    return layout.vocab_dim(plan.spec.weight_layout)


def _whole(w):
    """The ``BlockSpec`` of all of ``w`` (the kernels index it themselves)."""
    return pl.BlockSpec(w.shape, lambda *_: (0, 0))


def _forward(plan: TritonPlan, h, w, labels, temperature, min_logit) -> hm.Rows:
    (rows, hidden), vocab = h.shape, w.shape[_vocab_dim(plan)]
    blocks = plan.blocks
    t, splits = blocks.block_tokens, blocks.vocab_splits
    nv = pl.cdiv(vocab, blocks.block_vocab)
    kernel = functools.partial(
        _forward_kernel, plan=plan, hidden=hidden, vocab=vocab,
        tiles_per_split=pl.cdiv(nv, splits),
    )
    row_in = pl.BlockSpec((t,), lambda i, s: (i,))
    part = pl.BlockSpec((None, t), lambda i, s: (s, i))
    # formed by XLA, correctly rounded as in every other implementation (a float32 division
    # inside a Triton kernel is div.full.f32, off by up to 2 ulp)
    inv_temperature = 1.0 / temperature
    per_row = (labels, inv_temperature) + ((min_logit,) if plan.spec.truncated else ())
    partials = pl.pallas_call(
        kernel,
        grid=(rows // t, splits),
        in_specs=[
            pl.BlockSpec((t, hidden), lambda i, s: (i, 0)),
            _whole(w),
        ] + [row_in] * len(per_row),
        out_specs=[part] * 4,
        out_shape=[pallas_mode.out_shape((splits, rows), jnp.float32, h, w, labels)] * 4,
        name="jaxhead_head_forward",
        **_params(plan),
    )(h, w, *per_row)
    with_entropy = plan.spec.with_entropy
    stats = hm.combine(hm.Stats(*partials), inv_temperature[None], with_entropy,
                       lambda x: x.max(axis=0), lambda x: x.sum(axis=0))
    return hm.finalize(stats, inv_temperature, with_entropy)


def _du_chunk(plan: TritonPlan, h, w_c, rows):
    """``du [B, width]`` in the input dtype for the vocab entries of ``w_c`` (``[H, width]``
    or ``[width, H]``);
    ``rows = (labels relative to the chunk, inv_temperature, [min_logit,] m, log_s,
    entropy, g, e)``, ``[B]`` each."""
    (n, hidden), width = h.shape, w_c.shape[_vocab_dim(plan)]
    t, c = plan.blocks.block_tokens, plan.blocks.block_vocab
    nc = pl.cdiv(width, c)
    row_in = pl.BlockSpec((t,), lambda i, j: (i,))
    du = pl.pallas_call(
        functools.partial(_du_kernel, plan=plan, hidden=hidden, width=width),
        grid=(n // t, nc),
        in_specs=[
            pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
            _whole(w_c),
        ] + [row_in] * len(rows),
        out_specs=pl.BlockSpec((t, c), lambda i, j: (i, j)),
        out_shape=pallas_mode.out_shape((n, nc * c), h.dtype, h, w_c, *rows),
        name="jaxhead_head_dlogits",
        **_params(plan),
    )(h, w_c, *rows)
    return du if nc * c == width else du[:, :width]


def _backward(plan: TritonPlan, h, w, labels, temperature, min_logit, m, log_s, ent, g, e):
    """``(dh, dW)`` in the input dtype."""
    lay, axis = plan.spec.weight_layout, _vocab_dim(plan)
    vocab = w.shape[axis]
    chunk = plan.blocks.backward_vocab_chunk
    n_full, tail = divmod(vocab, chunk)
    inv_temperature = 1.0 / temperature  # by XLA, as in _forward
    rows = ((inv_temperature,) + ((min_logit,) if plan.spec.truncated else ())
            + (m, log_s, ent, g, e))

    def step(carry, w_c, off):
        dh, dw = carry
        du = _du_chunk(plan, h, w_c, (labels - off, *rows))
        dh = dh + layout.dhidden(du, w_c, lay)
        dw_c = layout.dweight(h, du, lay).astype(w.dtype)  # [H, Vc] or [Vc, H]
        return dh, lax.dynamic_update_slice_in_dim(dw, dw_c, off, axis)

    carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros_like(w))
    if n_full:

        def body(carry, idx):
            off = idx * chunk
            return step(carry, lax.dynamic_slice_in_dim(w, off, chunk, axis=axis), off), None

        carry, _ = lax.scan(body, carry, jnp.arange(n_full, dtype=jnp.int32))
    if tail:
        carry = step(carry, lax.slice_in_dim(w, n_full * chunk, vocab, axis=axis),
                     n_full * chunk)
    dh, dw = carry
    return dh.astype(h.dtype), dw


chunked_head = differentiable(_forward, _backward)

#: ``impl="pallas_triton"`` (``PallasTritonConfig``).
PALLAS_TRITON = Implementation(PallasTritonConfig, make_plan, chunked_head)
