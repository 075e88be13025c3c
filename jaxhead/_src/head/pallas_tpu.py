"""Fused LM head as Pallas Mosaic TPU kernels: logits tiles live in VMEM, never in HBM.

``impl="pallas_tpu"``: the contract of every implementation (``jaxhead._src.head.base``) and
the tile math of ``jaxhead._src.head.math``, with its own settings (``PallasTpuConfig``).
Three kernels, tiles of ``T`` tokens by ``C`` vocab columns (``PallasTpuConfig.block_tokens``,
``block_vocab``); ``nt = B / T`` token tiles, ``nv = ceil(V / C)`` vocab tiles:

A ``[V, H]`` weight (``HeadSpec.weight_layout == "vh"``, a tied embedding table) is read
in ``(C, H)`` blocks instead of ``(H, C)``, contracted on its H dimension in each kernel
(``jaxhead._src.head.layout``; Mosaic's transposed-operand matmuls), and ``dW`` is written
as ``[C, H]`` tiles of a ``[V, H]`` gradient: no transposed copy anywhere. Below, ``[H, C]``
stands for the weight's tile in either layout.

forward, grid ``(nt "parallel", nv "arbitrary")``
  VMEM: the ``h`` tile ``[T, H]`` (fetched once per token tile: its block index does not
  change along the vocab axis), the ``w`` tile ``[H, C]`` (double-buffered stream), the
  float32 logits tile ``[T, C]`` and its temporaries, scratch ``m, r, t, label logit``
  (float32 ``[T, 1]``) carried across the vocab axis. Outputs ``logp, entropy, m, log s``
  ``[T, 1]`` written at the last vocab tile. FLOPs ``2 B H V`` (matmul) + ~10 ``B V`` (VPU), ``B V`` exp
  (+ ``B V`` tanh with a soft-cap). HBM bytes: ``h`` once (``B H b``), ``w`` once per
  token tile (``nt H V b``), ~``16 B`` of per-row values (``b`` = bytes per element).

backward ``dh``, grid ``(nt "parallel", nv "arbitrary")``
  VMEM as the forward plus a float32 ``[T, H]`` accumulator and the ``[T, H]`` output tile.
  Each tile recomputes ``u = h w``, forms ``du`` (float32, cast to the input dtype) and
  accumulates ``du w^T``. FLOPs ``4 B H V``; bytes as the forward plus ``B H b`` out.

backward ``dW``, grid ``(nv "parallel", nt "arbitrary")``
  VMEM: the ``w`` tile (fetched once per vocab tile), the streamed ``h`` tile, a float32
  ``[H, C]`` accumulator and the ``[H, C]`` output tile. Recomputes ``du`` and accumulates
  ``h^T du``. FLOPs ``4 B H V``; HBM bytes ``V H b`` (``w``) + ``nv B H b`` (``h``) +
  ``V H b`` out.

Each output block is written by exactly one position of the "parallel" axis, so there are
no write races (checked with the TPU interpreter's race detector in the tests); the two
backward kernels cost one extra recompute (``10 B H V`` FLOPs for forward + backward, vs
``8`` for the fused XLA backward) in exchange for keeping each float32 accumulator in VMEM.

A vocabulary that is not a multiple of ``C`` gets a last, partial tile: its columns past
``V`` are masked (``-inf`` logits, zero ``du``, zeroed ``w`` before ``du w^T``) and the
partial ``dW`` block is written back only inside the array. ``B`` is a multiple of ``T``
(the padded row count of ``plan``).

Matmuls accumulate in float32; float32 inputs use ``Precision.HIGHEST`` (no bf16 passes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxhead import dispatch
from jaxhead._src.head import layout, pallas_mode
from jaxhead._src.head import math as hm
from jaxhead._src.head.base import HeadSpec, Implementation, differentiable
from jaxhead.dispatch import KernelUnsupported

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_LANES = 128
_INTERPRET_VMEM_BYTES = 64 * 2**20  # what interpret-mode plans assume (no chip to ask)
_UNKNOWN_TPU_VMEM_BYTES = 16 * 2**20  # a chip this jax does not know: the smallest (v4)
_VMEM_BUDGET = 0.75  # fraction of VMEM the tiles may plan for
_VMEM_CEILING = 0.9  # the largest scoped-VMEM limit a kernel asks for, of the physical
_MIN_VMEM_LIMIT = 32 * 2**20
_F32_VMEM_FACTOR = 1.5  # float32 HIGHEST matmuls: Mosaic's temporaries (see vmem_bytes)


@dataclasses.dataclass(frozen=True)
class PallasTpuConfig:
    """Settings of the ``"pallas_tpu"`` implementation.

    Attributes:
      block_tokens: rows ``T`` per tile, a multiple of 16 for bf16 and 8 for float32; None:
        ``default_blocks`` shrunk to fit the VMEM budget.
      block_vocab: vocab columns ``C`` per tile, a multiple of 128; None: as
        ``block_tokens``.

    Given sizes are used as they are (then shrunk to cover the rows / the vocabulary).
    """

    block_tokens: int | None = None
    block_vocab: int | None = None


@dataclasses.dataclass(frozen=True)
class TpuPlan:
    """The resolved static settings of one call (hashable: a ``custom_vjp`` static arg).

    Attributes:
      spec: the problem.
      block_tokens, block_vocab: the tile ``T x C`` (``C`` may equal ``V`` when ``V < C``).
      vmem_limit_bytes: the scoped-VMEM limit passed to Mosaic.
      interpret: a ``pallas_mode`` mode (None: compile for the TPU).
    """

    spec: HeadSpec
    block_tokens: int
    block_vocab: int
    vmem_limit_bytes: int
    interpret: str | None


def default_blocks(dtype) -> tuple[int, int]:
    """Starting tiles ``(T, C)``: ``T = 512`` (bf16) / ``256`` (float32), ``C = 512``.

    ``T`` sets the arithmetic intensity on the streamed ``w`` (``2 T`` FLOPs per byte of
    bf16 ``w``: 512 is above the ~240 of v5e and near the ~570 of v6e); ``plan`` halves the
    tiles while they do not fit the VMEM budget.
    """
    return (512 if jnp.dtype(dtype).itemsize == 2 else 256), 512


def vmem_bytes(block_tokens: int, block_vocab: int, hidden_size: int, itemsize: int) -> int:
    """Planned VMEM of the largest of the three kernels, in bytes (double-buffered blocks,
    float32 accumulators, ~6 float32 ``[T, C]`` temporaries, per-row ``[T, 1]`` blocks
    padded to 128 lanes), times 1.5 for float32 inputs.

    Calibrated against the TPU compiler (libtpu 0.0.52, v5e; the smallest scoped limit each
    kernel compiles under): bf16 ``T, C, H`` = 512, 512, 2048: forward / ``dh`` / ``dW`` use
    11.8 / 23.0 / 20.5 MiB, the formula says 28 MiB; 256, 512, 4096: 14.8 / 28.2 / 31.3 MiB
    for 33 MiB. float32 (the ``Precision.HIGHEST`` matmuls split each operand into bf16
    parts): 256, 512, 2048: 20.9 / 39.7 / 34.3 MiB for 29 x 1.5 = 43.5 MiB; 128, 256,
    2048: 10.3 / 17.8 / 16.8 MiB for 13.8 x 1.5 = 20.6 MiB. Without the factor the float32
    ``dh`` kernel overran the limit planned from it on v5p (36.35 MiB of 36.25).
    """
    t, c, h, b = block_tokens, block_vocab, hidden_size, itemsize
    common = 2 * t * h * b + 2 * h * c * b + 6 * t * c * 4 + 2 * 8 * t * _LANES * 4
    dh = common + 2 * t * h * b + t * h * 4 + h * c * b
    dw = common + 2 * h * c * b + h * c * 4
    return int(max(dh, dw) * (_F32_VMEM_FACTOR if b == 4 else 1.0))


def vmem_capacity() -> int:
    """VMEM of one TensorCore of the TPU the trace compiles for (``jaxhead.dispatch.
    target_platform``: the mesh set with ``jax.set_mesh``, else the default backend), from
    ``pltpu.get_tpu_info()``: v4 16 MiB, v5e 128 MiB, v5p 64 MiB, v6e 128 MiB (what the
    compiler enforces: larger kernels fail "would exceed memory"). Those are the physical
    sizes; the compiler's smaller scoped default (16 MiB before v6e, 32 MiB on v6e) does not
    apply, as every kernel passes its own ``vmem_limit_bytes``. A TPU this jax does not
    know: 16 MiB. Not compiling for a TPU (interpret mode): 64 MiB."""
    if dispatch.target_platform(pallas_mode.planned_mesh()) != "tpu":
        return _INTERPRET_VMEM_BYTES
    try:
        with pallas_mode.target_mesh():
            return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except (AttributeError, ValueError, RuntimeError):  # jax without get_tpu_info / new chip
        return _UNKNOWN_TPU_VMEM_BYTES


def _row_align(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _fit_blocks(t: int, c: int, hidden_size: int, itemsize: int, budget: int, align: int):
    while vmem_bytes(t, c, hidden_size, itemsize) > budget:
        if t > 128:
            t //= 2
        elif c > _LANES:
            c //= 2
        elif t > align:
            t = max(align, t // 2 // align * align)
        else:
            return None
    return t, c


def _blocks(config: PallasTpuConfig, spec: HeadSpec, dtype, align: int, capacity: int):
    """``(T, C)`` before shrinking to the rows: the config's, else the fitted defaults."""
    t0, c0 = default_blocks(dtype)
    if config.block_tokens is not None or config.block_vocab is not None:
        t, c = config.block_tokens or t0, config.block_vocab or c0
        if t < align or t % align:
            raise ValueError(
                f"PallasTpuConfig.block_tokens must be a positive multiple of {align} for "
                f"{dtype}, got {t}")
        if c < _LANES or c % _LANES:
            raise ValueError(
                f"PallasTpuConfig.block_vocab must be a positive multiple of {_LANES}, got {c}")
        return t, c
    fitted = _fit_blocks(t0, c0, spec.hidden_size, dtype.itemsize,
                         int(_VMEM_BUDGET * capacity), align)
    if fitted is None:
        raise KernelUnsupported(
            f"pallas_tpu: no tile fits {_VMEM_BUDGET:.0%} of {capacity} bytes of VMEM "
            f"with hidden size {spec.hidden_size}")
    return fitted


def make_plan(config: PallasTpuConfig | None, spec: HeadSpec) -> tuple[TpuPlan, int]:
    """``(TpuPlan, padded rows)``: ``T`` shrinks (keeping its alignment) to cover the rows
    in as few tiles, ``C`` becomes ``V`` when ``V <= C``.

    Raises:
      KernelUnsupported: not on a TPU and not interpreting, a dtype other than bf16 /
        float32, a vocab-parallel call, ``H`` too large for any tile to fit in VMEM, or
        given blocks that exceed it.
      ValueError: a misaligned block size (named).
    """
    mode = pallas_mode.interpret_mode()
    pallas_mode.check_runnable(mode, "tpu", "pallas_tpu")
    dtype = jnp.dtype(spec.dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise KernelUnsupported(f"pallas_tpu supports bf16 and float32, got {dtype}")
    if spec.vocab_axis is not None or spec.hidden_shards > 1:
        raise KernelUnsupported(f"pallas_tpu has no vocab-parallel variant and no hidden-split "
                                f"one (vocab_axis={spec.vocab_axis!r}, hidden_axes="
                                f"{spec.hidden_axes}); it runs on XLA")
    align = _row_align(dtype)
    capacity = vmem_capacity()
    t, c = _blocks(config or PallasTpuConfig(), spec, dtype, align, capacity)
    n_tiles = max(1, math.ceil(spec.rows / t))
    tokens = math.ceil(math.ceil(max(spec.rows, 1) / n_tiles) / align) * align
    vocab = min(spec.vocab_size, c)
    need = vmem_bytes(tokens, vocab, spec.hidden_size, dtype.itemsize)
    if need > _VMEM_CEILING * capacity:
        raise KernelUnsupported(
            f"pallas_tpu: tiles {tokens} x {vocab} need ~{need} bytes of VMEM, more than "
            f"{_VMEM_CEILING:.0%} of the {capacity} available")
    limit = int(min(_VMEM_CEILING * capacity, max(_MIN_VMEM_LIMIT, 1.25 * need)))
    plan = TpuPlan(spec, tokens, vocab, vmem_limit_bytes=limit, interpret=mode)
    return plan, n_tiles * tokens if spec.rows else 0


# ----------------------------------------------------------------------------- kernels


def _on_tiles(j, n_tiles: int, ragged: bool, step) -> None:
    """Run ``step(masked)`` for vocab tile ``j``: masked only on a ragged last tile."""
    if not ragged:
        step(False)
        return
    pl.when(j < n_tiles - 1)(lambda: step(False))
    pl.when(j == n_tiles - 1)(lambda: step(True))


def _tile_masks(j, shape, width: int, y, masked: bool):
    """``(valid or None, hit)`` for vocab tile ``j`` of a ``shape = (T, C)`` tile."""
    col = j * shape[1] + lax.broadcasted_iota(jnp.int32, shape, 1)
    return (col < width if masked else None), col == y


def _forward_kernel(h_ref, w_ref, y_ref, inv_temperature_ref, *refs, plan: TpuPlan,
                    vocab: int, n_vocab_tiles: int):
    spec = plan.spec
    ml_ref = refs[0] if spec.truncated else None
    *out_refs, m_sc, r_sc, t_sc, zy_sc = refs[1:] if spec.truncated else refs
    scratch = (m_sc, r_sc, t_sc, zy_sc)
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        for ref, value in zip(scratch, hm.init_stats(m_sc.shape), strict=True):
            ref[...] = value

    def step(masked: bool):
        z, _ = hm.logits(layout.logits(h_ref[...], w_ref[...], spec.weight_layout),
                         spec.softcap)
        valid, hit = _tile_masks(j, z.shape, vocab, y_ref[...], masked)
        inv_temperature = inv_temperature_ref[...]
        valid = hm.support(z, inv_temperature, None if ml_ref is None else ml_ref[...], hit,
                           valid)
        stats = hm.update(hm.Stats(*(ref[...] for ref in scratch)), z, inv_temperature, valid,
                          hit, spec.with_entropy)
        for ref, value in zip(scratch, stats, strict=True):
            ref[...] = value

    _on_tiles(j, n_vocab_tiles, vocab % plan.block_vocab != 0, step)

    @pl.when(j == n_vocab_tiles - 1)
    def _finish():
        rows = hm.finalize(hm.Stats(*(ref[...] for ref in scratch)), inv_temperature_ref[...],
                           spec.with_entropy)
        for ref, value in zip(out_refs, rows, strict=True):
            ref[...] = value


def _du_tile(plan: TpuPlan, j, h, w, rows, vocab: int, masked: bool):
    """float32 ``du [T, C]`` of vocab tile ``j``; ``rows``: ``(y, inv_temperature,
    [min_logit,] m, log_s, ent, g, e)`` ``[T, 1]`` each (``min_logit`` only in a truncated
    call)."""
    y, inv_temperature, *rest = rows
    ml = rest.pop(0) if plan.spec.truncated else None
    z, th = hm.logits(layout.logits(h, w, plan.spec.weight_layout), plan.spec.softcap)
    valid, hit = _tile_masks(j, z.shape, vocab, y, masked)
    valid = hm.support(z, inv_temperature, ml, hit, valid)
    return hm.dlogits(z, th, inv_temperature, *rest, valid, hit, plan.spec.with_entropy)


def _dh_kernel(h_ref, w_ref, *refs, plan: TpuPlan, vocab: int, n_vocab_tiles: int):
    *row_refs, dh_ref, acc_ref = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    lay = plan.spec.weight_layout
    axis = layout.vocab_dim(lay)

    def step(masked: bool):
        w = w_ref[...]
        if masked:  # the partial block's entries past V hold garbage: keep it out of du w^T
            col = j * w.shape[axis] + lax.broadcasted_iota(jnp.int32, w.shape, axis)
            w = jnp.where(col < vocab, w, jnp.zeros((), w.dtype))
        h = h_ref[...]
        du = _du_tile(plan, j, h, w, tuple(r[...] for r in row_refs), vocab, masked)
        acc_ref[...] += layout.dhidden(du.astype(h.dtype), w, lay)

    _on_tiles(j, n_vocab_tiles, vocab % plan.block_vocab != 0, step)

    @pl.when(j == n_vocab_tiles - 1)
    def _finish():
        dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, *refs, plan: TpuPlan, vocab: int, n_vocab_tiles: int):
    *row_refs, dw_ref, acc_ref = refs
    j = pl.program_id(0)
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        h = h_ref[...]
        du = _du_tile(plan, j, h, w_ref[...], tuple(r[...] for r in row_refs), vocab, masked)
        acc_ref[...] += layout.dweight(h, du.astype(h.dtype), plan.spec.weight_layout)

    _on_tiles(j, n_vocab_tiles, vocab % plan.block_vocab != 0, step)

    @pl.when(i == pl.num_programs(1) - 1)
    def _finish():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


# ----------------------------------------------------------------------------- calls


def _interpret_param(mode: str | None):
    if mode is None:
        return False
    if mode == "races":
        return pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)
    return pltpu.InterpretParams()


def _call(kernel, plan: TpuPlan, grid, in_specs, out_specs, out_shape, scratch, cost):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=plan.vmem_limit_bytes,
        ),
        cost_estimate=cost,
        interpret=_interpret_param(plan.interpret),
    )


def _row_inputs(plan: TpuPlan, labels, temperature, min_logit, *rest):
    """The per-row kernel inputs ``[B, 1]``: ``labels``, ``1 / temperature`` (formed here, by
    XLA as in every other implementation, so that the multiplier is the same float32 value:
    Mosaic's division need not round as XLA's does), ``min_logit`` only when truncated, then
    ``rest``."""
    ml = (min_logit,) if plan.spec.truncated else ()
    return tuple(x[:, None] for x in (labels, 1.0 / temperature, *ml, *rest))


def _w_block(plan: TpuPlan, hidden: int, tile):
    """The ``BlockSpec`` of vocab tile ``tile(*grid)`` of ``w``: ``(H, C)`` blocks of an
    ``[H, V]`` weight, ``(C, H)`` blocks of a ``[V, H]`` one."""
    c = plan.block_vocab
    if plan.spec.weight_layout == "hv":
        return pl.BlockSpec((hidden, c), lambda *g: (0, tile(*g)))
    return pl.BlockSpec((c, hidden), lambda *g: (tile(*g), 0))


def _vocab(plan: TpuPlan, w) -> int:
    return w.shape[layout.vocab_dim(plan.spec.weight_layout)]


def forward(plan: TpuPlan, h, w, labels, temperature, min_logit) -> hm.Rows:
    (rows, hidden), vocab = h.shape, _vocab(plan, w)
    t, c = plan.block_tokens, plan.block_vocab
    nt, nv = rows // t, pl.cdiv(vocab, c)
    row_spec = pl.BlockSpec((t, 1), lambda i, j: (i, 0))
    row_out = pallas_mode.out_shape((rows, 1), jnp.float32, h, w, labels)
    kernel = functools.partial(_forward_kernel, plan=plan, vocab=vocab, n_vocab_tiles=nv)
    b = h.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * rows * hidden * vocab + 12 * rows * vocab,
        transcendentals=rows * vocab * (2 if plan.spec.softcap else 1),
        bytes_accessed=rows * hidden * b + nt * hidden * vocab * b + 24 * rows,
    )
    rows = _row_inputs(plan, labels, temperature, min_logit)
    out = _call(
        kernel, plan, (nt, nv),
        [pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
         _w_block(plan, hidden, lambda i, j: j)] + [row_spec] * len(rows),
        [row_spec] * len(hm.Rows._fields), [row_out] * len(hm.Rows._fields),
        [pltpu.VMEM((t, 1), jnp.float32) for _ in hm.Stats._fields],
        cost,
    )(h, w, *rows)
    return hm.Rows(*(x[:, 0] for x in out))


def backward(plan: TpuPlan, h, w, labels, temperature, min_logit, m, log_s, ent, g, e):
    """``(dh, dW)`` in the input dtype."""
    rows = _row_inputs(plan, labels, temperature, min_logit, m, log_s, ent, g, e)
    (n, hidden), vocab = h.shape, _vocab(plan, w)
    t, c = plan.block_tokens, plan.block_vocab
    nt, nv = n // t, pl.cdiv(vocab, c)
    kw = {"plan": plan, "vocab": vocab, "n_vocab_tiles": nv}
    b = h.dtype.itemsize
    flops = 4 * n * hidden * vocab + 14 * n * vocab
    trans = n * vocab * (2 if plan.spec.softcap else 1)

    tok_row = pl.BlockSpec((t, 1), lambda i, j: (i, 0))
    dh = _call(
        functools.partial(_dh_kernel, **kw), plan, (nt, nv),
        [pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
         _w_block(plan, hidden, lambda i, j: j)] + [tok_row] * len(rows),
        pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
        pallas_mode.out_shape(h.shape, h.dtype, h, w, g),
        [pltpu.VMEM((t, hidden), jnp.float32)],
        pl.CostEstimate(flops=flops, transcendentals=trans,
                        bytes_accessed=2 * n * hidden * b + nt * hidden * vocab * b + 28 * n),
    )(h, w, *rows)

    voc_row = pl.BlockSpec((t, 1), lambda j, i: (i, 0))
    w_block = _w_block(plan, hidden, lambda j, i: j)
    dw = _call(
        functools.partial(_dw_kernel, **kw), plan, (nv, nt),
        [pl.BlockSpec((t, hidden), lambda j, i: (i, 0)), w_block] + [voc_row] * len(rows),
        w_block,
        pallas_mode.out_shape(w.shape, w.dtype, h, w, g),
        [pltpu.VMEM(w_block.block_shape, jnp.float32)],
        pl.CostEstimate(flops=flops, transcendentals=trans,
                        bytes_accessed=2 * hidden * vocab * b + nv * n * hidden * b + nv * 28 * n),
    )(h, w, *rows)
    return dh, dw


chunked_head = differentiable(forward, backward)


#: ``impl="pallas_tpu"`` (``PallasTpuConfig``).
PALLAS_TPU = Implementation(PallasTpuConfig, make_plan, chunked_head)
