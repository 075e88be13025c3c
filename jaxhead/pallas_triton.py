"""Fused LM head for GPUs through Pallas' Triton lowering: logits tiles stay in registers.

Same contract as ``jaxhead.xla.chunked_head`` (compacted rows ``h [B, H]``, ``w [H, V]``,
``labels [B]``, ``inv_temp [B]``; returns float32 ``(logZ, logp, entropy)``), with its own
config (``make_config``). Tiles: ``T`` tokens x ``C`` vocab columns, the hidden axis
stepped ``K`` at a time (``TritonBlocks``); ``nt = B / T``, ``nv = ceil(V / C)``.

forward kernel, grid ``(nt, S)``
  Program ``(i, s)`` owns token tile ``i`` and the ``s``-th of ``S`` contiguous ranges of
  vocab tiles. For each vocab tile it accumulates ``u = h w`` over ``H / K`` steps in a
  float32 ``[T, C]`` register tile (``[T, K]`` and ``[K, C]`` operand tiles pipelined
  through shared memory, ``num_stages`` deep), then folds it into per-row running
  ``m, s, t, label logit`` (float32 ``[T]`` registers). Outputs those four per range,
  float32 ``[S, B]``; XLA merges the ranges (``kernel_math.combine_stats``). FLOPs
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

``B`` need not be a multiple of ``T`` (rows are padded with zeros, label 0, inv_temp 1,
and sliced off); ``V`` need not be a multiple of ``C`` (loads past ``V`` are masked to 0,
those columns enter the statistics as ``-inf`` and get ``du = 0``; nothing is stored past
the chunk). float32 matmuls use IEEE float32 (``Precision.HIGHEST``), not TF32.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jaxhead import kernel_math as km
from jaxhead import pallas_mode

SUPPORTED_DTYPES = tuple(jnp.dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32))
_MIN_BLOCK = 16  # smallest tl.dot operand side
_TARGET_PROGRAMS = 1024  # forward programs to aim for (several waves on 132 SMs)
_DU_CHUNK_BYTES = 256 * 2**20


@dataclasses.dataclass(frozen=True)
class TritonBlocks:
    """Tile sizes and launch parameters of the Triton kernels (powers of two >= 16).

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

    block_tokens: int
    block_vocab: int
    block_hidden: int
    num_warps: int
    num_stages: int
    vocab_splits: int | None = None
    backward_vocab_chunk: int | None = None


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Static settings of one call (hashable: a ``custom_vjp`` non-differentiable arg).

    Attributes:
      softcap, with_entropy: as ``jaxhead.xla.ChunkConfig``.
      blocks: the resolved ``TritonBlocks`` (both optional fields set).
      interpret: a ``pallas_mode`` mode (None: compile with Triton).
    """

    softcap: float | None
    with_entropy: bool
    blocks: TritonBlocks
    interpret: str | None


def default_blocks(dtype) -> TritonBlocks:
    """Starting tiles for H100 / H200 (sm_90, 228 KiB shared memory per SM).

    16-bit inputs: ``T=64, C=256, K=64``, 8 warps, 3 stages: a 64 KiB float32 logit tile
    (64 registers a thread over 256 threads), 3 x 40 KiB of staged operands, and
    ``2 T C H / (2 T H) = C`` = 256 FLOPs per byte of the ``h`` panel re-read for each vocab
    tile. float32 (IEEE, no tensor-core fast path; meant for checks, not speed):
    ``T=64, C=128, K=32``, 8 warps, 2 stages. Tune on the device; all are overridable.
    """
    if jnp.dtype(dtype).itemsize == 2:
        return TritonBlocks(64, 256, 64, num_warps=8, num_stages=3)
    return TritonBlocks(64, 128, 32, num_warps=8, num_stages=2)


def _pow2_at_least(n: int) -> int:
    return max(_MIN_BLOCK, 1 << max(0, n - 1).bit_length())


def _check_pow2(blocks: TritonBlocks) -> None:
    for name in ("block_tokens", "block_vocab", "block_hidden"):
        v = getattr(blocks, name)
        if v < _MIN_BLOCK or v & (v - 1):
            raise ValueError(f"{name} must be a power of two >= {_MIN_BLOCK}, got {v}")


def make_config(
    num_rows: int,
    hidden_size: int,
    vocab_size: int,
    *,
    softcap: float | None,
    with_entropy: bool,
    dtype,
    blocks: TritonBlocks | None = None,
) -> tuple[TritonConfig, int]:
    """The ``TritonConfig`` for ``num_rows`` rows, and the padded row count it works on.

    ``T``, ``C`` and ``K`` shrink to the smallest power of two (>= 16) covering
    ``num_rows``, ``V`` and ``H`` when those are smaller; the optional fields of
    ``blocks`` are resolved.

    Raises:
      TypeError: ``blocks`` of another kernel's type.
      KernelUnsupported: not on a GPU and not interpreting, or a dtype other than
        bf16 / f16 / float32.
      ValueError: block sizes that are not powers of two >= 16, a backward chunk that is
        not a multiple of ``block_vocab``, or a non-positive split / warp / stage count.
    """
    mode = pallas_mode.interpret_mode()
    pallas_mode.check_platform(mode, "gpu", "pallas_triton")
    dtype = jnp.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        raise pallas_mode.KernelUnsupported(
            f"pallas_triton supports bf16, f16 and float32, got {dtype}"
        )
    blocks = default_blocks(dtype) if blocks is None else blocks
    if not isinstance(blocks, TritonBlocks):
        raise TypeError(
            f"blocks must be a pallas_triton.TritonBlocks, got {type(blocks).__name__}"
        )
    _check_pow2(blocks)
    if min(blocks.num_warps, blocks.num_stages, blocks.vocab_splits or 1) < 1:
        raise ValueError(f"num_warps, num_stages and vocab_splits must be >= 1: {blocks}")
    t = min(blocks.block_tokens, _pow2_at_least(num_rows))
    c = min(blocks.block_vocab, _pow2_at_least(vocab_size))
    k = min(blocks.block_hidden, _pow2_at_least(hidden_size))
    padded = math.ceil(num_rows / t) * t
    nt, nv = max(1, padded // t), pl.cdiv(vocab_size, c)
    splits = blocks.vocab_splits or math.ceil(_TARGET_PROGRAMS / nt)
    splits = pl.cdiv(nv, pl.cdiv(nv, min(splits, nv)))  # no empty range
    chunk = blocks.backward_vocab_chunk
    if chunk is None:
        chunk = max(1, _DU_CHUNK_BYTES // max(1, padded * dtype.itemsize * c)) * c
    elif chunk < c or chunk % c:
        raise ValueError(
            f"backward_vocab_chunk must be a positive multiple of block_vocab={c}, got {chunk}"
        )
    chunk = min(chunk, nv * c)
    resolved = dataclasses.replace(
        blocks, block_tokens=t, block_vocab=c, block_hidden=k, vocab_splits=splits,
        backward_vocab_chunk=chunk,
    )
    cfg = TritonConfig(softcap=softcap, with_entropy=with_entropy, blocks=resolved, interpret=mode)
    return cfg, padded


# ----------------------------------------------------------------------------- kernels


def _logits_tile(h_ref, w_ref, col0, hidden: int, width: int, blocks: TritonBlocks):
    """float32 ``u [T, C] = h_tile @ w[:, col0:col0 + C]``, loads masked past ``width``/``H``."""
    c, k = blocks.block_vocab, blocks.block_hidden
    cols = col0 + jnp.arange(c)
    col_ok = (cols < width)[None, :] if width % c else None

    def step(kk, acc):
        ks = pl.ds(kk * k, k)
        row_ok = None
        if hidden % k:
            row_ok = (kk * k + jnp.arange(k)) < hidden
        h_mask = None if row_ok is None else row_ok[None, :]
        w_mask = col_ok
        if row_ok is not None:
            w_mask = row_ok[:, None] if w_mask is None else row_ok[:, None] & w_mask
        h = plgpu.load(h_ref.at[:, ks], mask=h_mask, other=0.0 if h_mask is not None else None)
        w = plgpu.load(
            w_ref.at[ks, pl.ds(col0, c)], mask=w_mask, other=0.0 if w_mask is not None else None
        )
        return acc + km.matmul(h, w, (1, 0))

    acc = jnp.zeros((blocks.block_tokens, c), jnp.float32)
    return lax.fori_loop(0, pl.cdiv(hidden, k), step, acc), cols


def _masks(cols, width: int, block_vocab: int, y):
    """``(valid [1, C] or None, hit [T, C])``; ``y`` is ``[T, 1]`` relative to ``cols``."""
    hit = cols[None, :] == y
    if width % block_vocab == 0:
        return None, hit
    valid = (cols < width)[None, :]
    return valid, hit & valid


def _forward_kernel(
    h_ref, w_ref, y_ref, it_ref, m_ref, s_ref, t_ref, zy_ref,
    *, cfg: TritonConfig, hidden: int, vocab: int, tiles_per_split: int,
):
    blocks = cfg.blocks
    c = blocks.block_vocab
    y = y_ref[...][:, None]
    it = it_ref[...][:, None]
    first = pl.program_id(1) * tiles_per_split
    last = jnp.minimum(first + tiles_per_split, pl.cdiv(vocab, c))

    def body(j, stats):
        u, cols = _logits_tile(h_ref, w_ref, j * c, hidden, vocab, blocks)
        l, _ = km.logits(u, it, cfg.softcap)
        valid, hit = _masks(cols, vocab, c, y)
        return km.update_stats(stats, l, valid, hit, cfg.with_entropy)

    stats = lax.fori_loop(first, last, body, km.init_stats(blocks.block_tokens))
    for ref, value in zip((m_ref, s_ref, t_ref, zy_ref), stats):
        ref[...] = value.reshape(blocks.block_tokens)


def _du_kernel(
    h_ref, w_ref, y_ref, it_ref, logz_ref, ent_ref, g_ref, e_ref, du_ref,
    *, cfg: TritonConfig, hidden: int, width: int,
):
    blocks = cfg.blocks
    c = blocks.block_vocab
    y, it, logz, ent, g, e = (
        r[...][:, None] for r in (y_ref, it_ref, logz_ref, ent_ref, g_ref, e_ref)
    )
    u, cols = _logits_tile(h_ref, w_ref, pl.program_id(1) * c, hidden, width, blocks)
    l, th = km.logits(u, it, cfg.softcap)
    valid, hit = _masks(cols, width, c, y)
    du = km.dlogits(l, th, it, logz, ent, g, e, valid, hit, cfg.with_entropy)
    du_ref[...] = du.astype(du_ref.dtype)


# ----------------------------------------------------------------------------- calls


def _params(cfg: TritonConfig):
    return {
        "compiler_params": plgpu.CompilerParams(
            num_warps=cfg.blocks.num_warps, num_stages=cfg.blocks.num_stages
        ),
        "interpret": cfg.interpret is not None,
    }


def _forward(cfg: TritonConfig, h, w, labels, inv_temp):
    """float32 ``(logZ, logp, entropy)`` ``[B]``; ``B % T == 0``."""
    (rows, hidden), vocab = h.shape, w.shape[1]
    blocks = cfg.blocks
    t, splits = blocks.block_tokens, blocks.vocab_splits
    nv = pl.cdiv(vocab, blocks.block_vocab)
    kernel = functools.partial(
        _forward_kernel, cfg=cfg, hidden=hidden, vocab=vocab,
        tiles_per_split=pl.cdiv(nv, splits),
    )
    row_in = pl.BlockSpec((t,), lambda i, s: (i,))
    part = pl.BlockSpec((None, t), lambda i, s: (s, i))
    partials = pl.pallas_call(
        kernel,
        grid=(rows // t, splits),
        in_specs=[
            pl.BlockSpec((t, hidden), lambda i, s: (i, 0)),
            pl.BlockSpec((hidden, vocab), lambda i, s: (0, 0)),
            row_in,
            row_in,
        ],
        out_specs=[part] * 4,
        out_shape=[jax.ShapeDtypeStruct((splits, rows), jnp.float32)] * 4,
        name="jaxhead_head_forward",
        **_params(cfg),
    )(h, w, labels, inv_temp)
    return km.finalize(km.combine_stats(tuple(partials)), cfg.with_entropy)


def _du_chunk(cfg: TritonConfig, h, w_c, rows):
    """``du [B, width]`` in the input dtype for the columns of ``w_c [H, width]``;
    ``rows = (labels relative to the chunk, inv_temp, logZ, entropy, g, e)``, ``[B]``."""
    (n, hidden), width = h.shape, w_c.shape[1]
    t, c = cfg.blocks.block_tokens, cfg.blocks.block_vocab
    nc = pl.cdiv(width, c)
    row_in = pl.BlockSpec((t,), lambda i, j: (i,))
    du = pl.pallas_call(
        functools.partial(_du_kernel, cfg=cfg, hidden=hidden, width=width),
        grid=(n // t, nc),
        in_specs=[
            pl.BlockSpec((t, hidden), lambda i, j: (i, 0)),
            pl.BlockSpec((hidden, width), lambda i, j: (0, 0)),
        ] + [row_in] * len(rows),
        out_specs=pl.BlockSpec((t, c), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((n, nc * c), h.dtype),
        name="jaxhead_head_dlogits",
        **_params(cfg),
    )(h, w_c, *rows)
    return du if nc * c == width else du[:, :width]


def _backward(cfg: TritonConfig, h, w, labels, rows):
    """``(dh, dW)`` in the input dtype; ``rows = (inv_temp, logZ, entropy, g, e)`` ``[B]``."""
    vocab = w.shape[1]
    chunk = cfg.blocks.backward_vocab_chunk
    n_full, tail = divmod(vocab, chunk)

    def step(carry, w_c, off):
        dh, dw = carry
        du = _du_chunk(cfg, h, w_c, (labels - off,) + rows)
        dh = dh + km.matmul(du, w_c, (1, 1))
        dw_c = km.matmul(h, du, (0, 0)).astype(w.dtype)
        return dh, lax.dynamic_update_slice_in_dim(dw, dw_c, off, 1)

    carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros_like(w))
    if n_full:

        def body(carry, idx):
            off = idx * chunk
            return step(carry, lax.dynamic_slice_in_dim(w, off, chunk, axis=1), off), None

        carry, _ = lax.scan(body, carry, jnp.arange(n_full, dtype=jnp.int32))
    if tail:
        carry = step(carry, w[:, n_full * chunk :], n_full * chunk)
    dh, dw = carry
    return dh.astype(h.dtype), dw


# ----------------------------------------------------------------------------- custom_vjp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _head(cfg: TritonConfig, h, w, labels, inv_temp):
    out, _ = _head_fwd(cfg, h, w, labels, inv_temp)
    return out


def _head_fwd(cfg, h, w, labels, inv_temp):
    vocab = w.shape[1]
    logz, logp, ent = _forward(cfg, h, w, labels, inv_temp)
    logp = jnp.where((labels >= 0) & (labels < vocab), logp, jnp.nan)
    return (logz, logp, ent), (h, w, labels, inv_temp, logz, ent)


def _head_bwd(cfg, res, cts):
    h, w, labels, inv_temp, logz, ent = res
    _, g, e = cts
    rows = (inv_temp, logz, ent, g.astype(jnp.float32), e.astype(jnp.float32))
    dh, dw = _backward(cfg, h, w, labels, rows)
    return dh, dw, None, None


_head.defvjp(_head_fwd, _head_bwd)


def chunked_head(cfg: TritonConfig, h, w, labels, inv_temp):
    """float32 ``(logZ, logp, entropy)``, each ``[B]``, for compacted rows (Triton kernels).

    Args:
      cfg: from ``make_config``; ``B`` need not be a multiple of the token tile.
      h: ``[B, H]`` hidden rows (bf16, f16 or float32), padded rows all zero.
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
    pad = -rows % cfg.blocks.block_tokens
    if pad:
        h = jnp.pad(h, ((0, pad), (0, 0)))
        labels = jnp.pad(labels, (0, pad))
        inv_temp = jnp.pad(inv_temp, (0, pad), constant_values=1.0)
    logz, logp, ent = _head(
        cfg, h, w, labels.astype(jnp.int32), lax.stop_gradient(inv_temp.astype(jnp.float32))
    )
    return logz[:rows], logp[:rows], ent[:rows]
