"""Fused LM head as Pallas Mosaic TPU kernels: logits tiles live in VMEM, never in HBM.

Same contract as ``jaxhead.xla.chunked_head`` (compacted rows ``h [B, H]``, ``w [H, V]``,
``labels [B]``, ``inv_temp [B]``; returns float32 ``(logZ, logp, entropy)``), with its own
config (``make_config``). Three kernels, tiles of ``T`` tokens by ``C`` vocab columns
(``TpuBlocks``); ``nt = B / T`` token tiles, ``nv = ceil(V / C)`` vocab tiles:

forward, grid ``(nt "parallel", nv "arbitrary")``
  VMEM: the ``h`` tile ``[T, H]`` (fetched once per token tile: its block index does not
  change along the vocab axis), the ``w`` tile ``[H, C]`` (double-buffered stream), the
  float32 logits tile ``[T, C]`` and its temporaries, scratch ``m, s, t, label logit``
  (float32 ``[T, 1]``) carried across the vocab axis. Outputs ``[T, 1]`` written at the
  last vocab tile. FLOPs ``2 B H V`` (matmul) + ~10 ``B V`` (VPU), ``B V`` exp
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
partial ``dW`` block is written back only inside the array. ``B`` need not be a multiple
of ``T``: rows are padded with zeros (label 0, ``inv_temp`` 1) and sliced off.

Matmuls accumulate in float32; float32 inputs use ``Precision.HIGHEST`` (no bf16 passes).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxhead import kernel_math as km
from jaxhead import pallas_mode

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_LANES = 128
_DEFAULT_VMEM_BYTES = 64 * 2**20
_VMEM_BUDGET = 0.75  # fraction of VMEM the tiles may plan for
_MIN_VMEM_LIMIT = 32 * 2**20


@dataclasses.dataclass(frozen=True)
class TpuBlocks:
    """Tile sizes of the TPU kernels.

    Attributes:
      block_tokens: rows ``T`` per tile; a multiple of 16 for bf16, 8 for float32.
      block_vocab: vocab columns ``C`` per tile; a multiple of 128.
    """

    block_tokens: int
    block_vocab: int


@dataclasses.dataclass(frozen=True)
class TpuConfig:
    """Static settings of one call (hashable: a ``custom_vjp`` non-differentiable arg).

    Attributes:
      softcap, with_entropy: as ``jaxhead.xla.ChunkConfig``.
      block_tokens, block_vocab: the tile ``T x C`` (``C`` may equal ``V`` when ``V < C``).
      vmem_limit_bytes: the scoped-VMEM limit passed to Mosaic.
      interpret: a ``pallas_mode`` mode (None: compile for the TPU).
    """

    softcap: float | None
    with_entropy: bool
    block_tokens: int
    block_vocab: int
    vmem_limit_bytes: int
    interpret: str | None


def default_blocks(dtype) -> TpuBlocks:
    """Starting tiles: ``T = 512`` (bf16) / ``256`` (float32), ``C = 512``.

    ``T`` sets the arithmetic intensity on the streamed ``w`` (``2 T`` FLOPs per byte of
    bf16 ``w``: 512 is above the ~240 of v5e and near the ~570 of v6e); ``make_config``
    halves the tiles while they do not fit the VMEM budget.
    """
    return TpuBlocks(block_tokens=512 if jnp.dtype(dtype).itemsize == 2 else 256, block_vocab=512)


def vmem_bytes(block_tokens: int, block_vocab: int, hidden_size: int, itemsize: int) -> int:
    """Planned VMEM of the largest of the three kernels, in bytes (double-buffered blocks,
    float32 accumulators, ~6 float32 ``[T, C]`` temporaries, per-row ``[T, 1]`` blocks
    padded to 128 lanes)."""
    t, c, h, b = block_tokens, block_vocab, hidden_size, itemsize
    common = 2 * t * h * b + 2 * h * c * b + 6 * t * c * 4 + 2 * 8 * t * _LANES * 4
    dh = common + 2 * t * h * b + t * h * 4 + h * c * b
    dw = common + 2 * h * c * b + h * c * 4
    return max(dh, dw)


def _vmem_capacity() -> int:
    if jax.default_backend() != "tpu":
        return _DEFAULT_VMEM_BYTES
    try:
        return int(pltpu.get_tpu_info().vmem_capacity_bytes)
    except (AttributeError, ValueError, RuntimeError):  # jax without get_tpu_info / new chip
        return _DEFAULT_VMEM_BYTES


def _row_align(dtype) -> int:
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _fit_blocks(blocks: TpuBlocks, hidden_size: int, itemsize: int, budget: int, align: int):
    t, c = blocks.block_tokens, blocks.block_vocab
    while vmem_bytes(t, c, hidden_size, itemsize) > budget:
        if t > 128:
            t //= 2
        elif c > _LANES:
            c //= 2
        elif t > align:
            t = max(align, t // 2 // align * align)
        else:
            return None
    return TpuBlocks(t, c)


def make_config(
    num_rows: int,
    hidden_size: int,
    vocab_size: int,
    *,
    softcap: float | None,
    with_entropy: bool,
    dtype,
    blocks: TpuBlocks | None = None,
) -> tuple[TpuConfig, int]:
    """The ``TpuConfig`` for ``num_rows`` rows, and the padded row count it works on.

    Without ``blocks``, ``default_blocks(dtype)`` shrunk to fit 3/4 of the chip's VMEM;
    given ``blocks`` are used as they are. ``T`` then shrinks (keeping its alignment) to
    cover ``num_rows`` in as few tiles, and ``C`` becomes ``V`` when ``V <= C``.

    Raises:
      TypeError: ``blocks`` of another kernel's type.
      KernelUnsupported: not on a TPU and not interpreting, a dtype other than bf16 /
        float32, ``H`` too large for any tile to fit in VMEM, or given ``blocks`` that
        exceed it.
      ValueError: ``blocks`` with a misaligned size.
    """
    mode = pallas_mode.interpret_mode()
    pallas_mode.check_platform(mode, "tpu", "pallas_tpu")
    dtype = jnp.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise pallas_mode.KernelUnsupported(f"pallas_tpu supports bf16 and float32, got {dtype}")
    align = _row_align(dtype)
    capacity = _vmem_capacity()
    if blocks is None:
        fitted = _fit_blocks(
            default_blocks(dtype), hidden_size, dtype.itemsize, int(_VMEM_BUDGET * capacity), align
        )
        if fitted is None:
            raise pallas_mode.KernelUnsupported(
                f"pallas_tpu: no tile fits {_VMEM_BUDGET:.0%} of {capacity} bytes of VMEM "
                f"with hidden size {hidden_size}"
            )
        blocks = fitted
    if not isinstance(blocks, TpuBlocks):
        raise TypeError(f"blocks must be a pallas_tpu.TpuBlocks, got {type(blocks).__name__}")
    if blocks.block_tokens < align or blocks.block_tokens % align:
        raise ValueError(
            f"block_tokens must be a positive multiple of {align} for {dtype}, "
            f"got {blocks.block_tokens}"
        )
    if blocks.block_vocab < _LANES or blocks.block_vocab % _LANES:
        raise ValueError(
            f"block_vocab must be a positive multiple of {_LANES}, got {blocks.block_vocab}"
        )
    n_tiles = max(1, math.ceil(num_rows / blocks.block_tokens))
    tokens = math.ceil(math.ceil(max(num_rows, 1) / n_tiles) / align) * align
    vocab = min(vocab_size, blocks.block_vocab)
    need = vmem_bytes(tokens, vocab, hidden_size, dtype.itemsize)
    if need > 0.9 * capacity:
        raise pallas_mode.KernelUnsupported(
            f"pallas_tpu: tiles {tokens} x {vocab} need ~{need} bytes of VMEM, more than 90% "
            f"of the {capacity} available"
        )
    cfg = TpuConfig(
        softcap=softcap,
        with_entropy=with_entropy,
        block_tokens=tokens,
        block_vocab=vocab,
        vmem_limit_bytes=int(min(0.9 * capacity, max(_MIN_VMEM_LIMIT, 1.25 * need))),
        interpret=mode,
    )
    return cfg, n_tiles * tokens if num_rows else 0


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
    hit = col == y
    if not masked:
        return None, hit
    valid = col < width
    return valid, hit & valid


def _forward_kernel(
    h_ref, w_ref, y_ref, it_ref,  # inputs
    logz_ref, logp_ref, ent_ref,  # outputs
    m_sc, s_sc, t_sc, zy_sc,  # scratch
    *, cfg: TpuConfig, vocab: int, n_vocab_tiles: int,
):
    j = pl.program_id(1)
    scratch = (m_sc, s_sc, t_sc, zy_sc)

    @pl.when(j == 0)
    def _init():
        for ref, value in zip(scratch, km.init_stats(m_sc.shape[0])):
            ref[...] = value

    def step(masked: bool):
        u = km.matmul(h_ref[...], w_ref[...], (1, 0))
        l, _ = km.logits(u, it_ref[...], cfg.softcap)
        valid, hit = _tile_masks(j, l.shape, vocab, y_ref[...], masked)
        stats = km.update_stats(
            tuple(ref[...] for ref in scratch), l, valid, hit, cfg.with_entropy
        )
        for ref, value in zip(scratch, stats):
            ref[...] = value

    _on_tiles(j, n_vocab_tiles, vocab % cfg.block_vocab != 0, step)

    @pl.when(j == n_vocab_tiles - 1)
    def _finish():
        logz, logp, ent = km.finalize(tuple(ref[...] for ref in scratch), cfg.with_entropy)
        logz_ref[...] = logz
        logp_ref[...] = logp
        ent_ref[...] = ent


def _du_tile(cfg: TpuConfig, j, h, w, rows, vocab: int, masked: bool):
    """float32 ``du [T, C]`` of vocab tile ``j``; ``rows = (y, inv_temp, logz, ent, g, e)``."""
    y, it, logz, ent, g, e = rows
    u = km.matmul(h, w, (1, 0))
    l, th = km.logits(u, it, cfg.softcap)
    valid, hit = _tile_masks(j, l.shape, vocab, y, masked)
    return km.dlogits(l, th, it, logz, ent, g, e, valid, hit, cfg.with_entropy)


def _dh_kernel(h_ref, w_ref, *refs, cfg: TpuConfig, vocab: int, n_vocab_tiles: int):
    *row_refs, dh_ref, acc_ref = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        w = w_ref[...]
        if masked:  # the partial block's columns past V hold garbage: keep it out of du w^T
            col = j * w.shape[1] + lax.broadcasted_iota(jnp.int32, w.shape, 1)
            w = jnp.where(col < vocab, w, jnp.zeros((), w.dtype))
        h = h_ref[...]
        du = _du_tile(cfg, j, h, w, tuple(r[...] for r in row_refs), vocab, masked)
        acc_ref[...] += km.matmul(du.astype(h.dtype), w, (1, 1))

    _on_tiles(j, n_vocab_tiles, vocab % cfg.block_vocab != 0, step)

    @pl.when(j == n_vocab_tiles - 1)
    def _finish():
        dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)


def _dw_kernel(h_ref, w_ref, *refs, cfg: TpuConfig, vocab: int, n_vocab_tiles: int):
    *row_refs, dw_ref, acc_ref = refs
    j = pl.program_id(0)
    i = pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    def step(masked: bool):
        h = h_ref[...]
        du = _du_tile(cfg, j, h, w_ref[...], tuple(r[...] for r in row_refs), vocab, masked)
        acc_ref[...] += km.matmul(h, du.astype(h.dtype), (0, 0))

    _on_tiles(j, n_vocab_tiles, vocab % cfg.block_vocab != 0, step)

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


def _grid(cfg: TpuConfig, rows: int, vocab: int) -> tuple[int, int]:
    return rows // cfg.block_tokens, pl.cdiv(vocab, cfg.block_vocab)


def _call(kernel, cfg: TpuConfig, grid, in_specs, out_specs, out_shape, scratch, semantics, cost):
    return pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=semantics, vmem_limit_bytes=cfg.vmem_limit_bytes
        ),
        cost_estimate=cost,
        interpret=_interpret_param(cfg.interpret),
    )


def _forward(cfg: TpuConfig, h, w, y, it):
    """Kernel outputs ``(logZ, logp, entropy)`` float32 ``[B, 1]``; ``B % T == 0``."""
    (rows, hidden), vocab = h.shape, w.shape[1]
    t, c = cfg.block_tokens, cfg.block_vocab
    nt, nv = _grid(cfg, rows, vocab)
    row_spec = pl.BlockSpec((t, 1), lambda i, j: (i, 0))
    row_out = jax.ShapeDtypeStruct((rows, 1), jnp.float32)
    kernel = functools.partial(_forward_kernel, cfg=cfg, vocab=vocab, n_vocab_tiles=nv)
    b = h.dtype.itemsize
    cost = pl.CostEstimate(
        flops=2 * rows * hidden * vocab + 10 * rows * vocab,
        transcendentals=rows * vocab * (2 if cfg.softcap else 1),
        bytes_accessed=rows * hidden * b + nt * hidden * vocab * b + 20 * rows,
    )
    return _call(
        kernel, cfg, (nt, nv),
        [
            pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
            pl.BlockSpec((hidden, c), lambda i, j: (0, j)),
            row_spec,
            row_spec,
        ],
        [row_spec] * 3,
        [row_out] * 3,
        [pltpu.VMEM((t, 1), jnp.float32) for _ in range(4)],
        ("parallel", "arbitrary"),
        cost,
    )(h, w, y, it)


def _backward(cfg: TpuConfig, h, w, rows):
    """``(dh, dW)`` in the input dtype; ``rows``: the six ``[B, 1]`` per-row arrays."""
    (n, hidden), vocab = h.shape, w.shape[1]
    t, c = cfg.block_tokens, cfg.block_vocab
    nt, nv = _grid(cfg, n, vocab)
    kw = {"cfg": cfg, "vocab": vocab, "n_vocab_tiles": nv}
    b = h.dtype.itemsize
    flops = 4 * n * hidden * vocab + 12 * n * vocab
    trans = n * vocab * (2 if cfg.softcap else 1)

    tok_row = pl.BlockSpec((t, 1), lambda i, j: (i, 0))
    dh = _call(
        functools.partial(_dh_kernel, **kw), cfg, (nt, nv),
        [
            pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
            pl.BlockSpec((hidden, c), lambda i, j: (0, j)),
        ] + [tok_row] * len(rows),
        pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
        jax.ShapeDtypeStruct(h.shape, h.dtype),
        [pltpu.VMEM((t, hidden), jnp.float32)],
        ("parallel", "arbitrary"),
        pl.CostEstimate(
            flops=flops, transcendentals=trans,
            bytes_accessed=2 * n * hidden * b + nt * hidden * vocab * b + 24 * n,
        ),
    )(h, w, *rows)

    voc_row = pl.BlockSpec((t, 1), lambda j, i: (i, 0))
    dw = _call(
        functools.partial(_dw_kernel, **kw), cfg, (nv, nt),
        [
            pl.BlockSpec((t, hidden), lambda j, i: (i, 0)),
            pl.BlockSpec((hidden, c), lambda j, i: (0, j)),
        ] + [voc_row] * len(rows),
        pl.BlockSpec((hidden, c), lambda j, i: (0, j)),
        jax.ShapeDtypeStruct(w.shape, w.dtype),
        [pltpu.VMEM((hidden, c), jnp.float32)],
        ("parallel", "arbitrary"),
        pl.CostEstimate(
            flops=flops, transcendentals=trans,
            bytes_accessed=2 * hidden * vocab * b + nv * n * hidden * b + nv * 24 * n,
        ),
    )(h, w, *rows)
    return dh, dw


# ----------------------------------------------------------------------------- custom_vjp


def _with_label_rule(logp, labels, vocab: int):
    """``logp = NaN`` where the label is outside ``[0, V)`` (as ``jaxhead.xla``)."""
    ok = (labels >= 0) & (labels < vocab)
    return jnp.where(ok, logp, jnp.nan)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(cfg: TpuConfig, h, w, labels, inv_temp):
    out, _ = _head_fwd(cfg, h, w, labels, inv_temp)
    return out


def _head_fwd(cfg, h, w, labels, inv_temp):
    y, it = labels[:, None], inv_temp[:, None]
    logz, logp, ent = (x[:, 0] for x in _forward(cfg, h, w, y, it))
    logp = _with_label_rule(logp, labels, w.shape[1])
    return (logz, logp, ent), (h, w, labels, inv_temp, logz, ent)


def _head_bwd(cfg, res, cts):
    h, w, labels, inv_temp, logz, ent = res
    _, g, e = cts
    rows = tuple(
        x.astype(dt)[:, None]
        for x, dt in zip(
            (labels, inv_temp, logz, ent, g, e),
            (jnp.int32,) + (jnp.float32,) * 5,
        )
    )
    dh, dw = _backward(cfg, h, w, rows)
    return dh, dw, None, None


_head.defvjp(_head_fwd, _head_bwd)


def chunked_head(cfg: TpuConfig, h, w, labels, inv_temp):
    """float32 ``(logZ, logp, entropy)``, each ``[B]``, for compacted rows (TPU kernels).

    Args:
      cfg: from ``make_config``; ``B`` need not be a multiple of ``cfg.block_tokens``.
      h: ``[B, H]`` hidden rows (bf16 or float32), padded rows all zero.
      w: ``[H, V]`` head weight, same dtype as ``h``.
      labels: int32 ``[B]`` in ``[0, V)``; a label outside gives ``logp = NaN``.
      inv_temp: float32 ``[B]``, ``1 / temperature`` (no gradient flows to it).

    Returns:
      ``(logZ, logp, entropy)`` float32 ``[B]``; ``entropy`` is zeros without
      ``cfg.with_entropy``. Differentiable w.r.t. ``h`` and ``w`` through ``logp`` and
      ``entropy``; gradients in the input dtype, accumulated in float32.
    """
    rows = h.shape[0]
    if rows == 0:
        zero = jnp.zeros((0,), jnp.float32)
        return zero, zero, zero
    pad = -rows % cfg.block_tokens
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad))
        inv_temp = jnp.pad(inv_temp, (0, pad), constant_values=1.0)
    logz, logp, ent = _head(
        cfg, h, w, labels.astype(jnp.int32), jax.lax.stop_gradient(inv_temp.astype(jnp.float32))
    )
    return logz[:rows], logp[:rows], ent[:rows]
