"""``impl="xla_cpu"``: the XLA chunked head with tuning for XLA's CPU backend (what
``impl="auto"`` picks on CPU). Same algorithm and numbers as ``"xla"`` (the same tests run
on both); only how XLA:CPU is steered differs:

* XLA:CPU moves bf16 through slices as float32 and hoists loop-invariant conversions: a
  naive vocab loop converts all of ``w`` (2.3 GB at Qwen3 scale) before the loop. The scans
  therefore carry ``w`` and the hidden rows behind an ``optimization_barrier``, so only one
  chunk is converted per step.
* It widens a bf16 dynamic-update-slice to float32 over the whole operand, so each ``dw``
  chunk write would cost a pass over all of ``dw``: the chunks go into a ``uint16`` view
  instead (an in-place integer update) and one bitcast at the end makes the bf16 result,
  while ``dw`` is at most ``XlaCpuConfig.dw_bits_max_bytes`` (the price is one ``dw``-sized
  temporary).
* On CPUs without bf16 matrix units (no AMX, no AVX512-BF16) 16-bit tiles are widened to
  float32 before the matmuls (faster there, and exact).
* ``h^T`` is materialised before ``h^T du``: XLA's CPU dot runs a transposed-operand
  product at about half speed. A ``"vh"`` weight's ``dw`` chunk is accumulated as the
  same ``[H, C]`` product and transposed once per vocab chunk when written (forming
  ``du^T`` per token tile instead made its backward twice as slow as ``"hv"``'s).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax

from jaxhead._src.head import layout, xla
from jaxhead._src.head import math as hm
from jaxhead._src.head import scan as sc
from jaxhead._src.head.base import HeadSpec, Implementation


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """True if this x86 CPU has AMX or AVX512-BF16 (``/proc/cpuinfo``; XLA then runs bf16
    dots natively). False when the file cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


@dataclasses.dataclass(frozen=True)
class XlaCpuConfig(xla.XlaConfig):
    """Settings of the ``"xla_cpu"`` implementation: ``XlaConfig``'s, and

    Attributes:
      dw_bits_max_bytes: 16-bit ``dw`` chunks are written through a ``uint16`` view while
        ``dw`` is at most this many bytes (0: never).
      bf16_matmul: whether the CPU multiplies bf16 natively; None: detect it
        (``cpu_has_bf16_matmul``). False widens 16-bit tiles to float32.
    """

    dw_bits_max_bytes: int = 512 * 2**20
    bf16_matmul: bool | None = None


class _CpuDwBuffer(sc.DwBuffer):
    """``dw`` chunks arrive as ``[H, C]`` (``CpuTuning.dw_tile``) and are written in the
    weight's layout: a ``"vh"`` weight's (``axis`` 0) transposed to ``[C, H]`` here."""

    def oriented(self, dw_c):
        return dw_c if self.axis == 1 else dw_c.T

    def write(self, dw, dw_c, off):
        return super().write(dw, self.oriented(dw_c), off)


class _BitsDwBuffer(_CpuDwBuffer):
    """``dw`` written through a ``uint16`` view (see the module docstring)."""

    def __init__(self, w, axis: int):
        self.dtype, self.axis = w.dtype, axis
        self.init = jnp.zeros(w.shape, jnp.uint16)

    def write(self, dw, dw_c, off):
        update = lax.bitcast_convert_type(self.oriented(dw_c).astype(self.dtype), jnp.uint16)
        return lax.dynamic_update_slice_in_dim(dw, update, off, self.axis)

    def finish(self, dw):
        return lax.bitcast_convert_type(dw, self.dtype)


@dataclasses.dataclass(frozen=True)
class CpuTuning(sc.Tuning):
    """XLA:CPU steering (module docstring): pinned operands, optional float32 tiles for
    16-bit inputs, ``h^T`` materialised, ``dw`` through ``uint16`` bits."""

    pin_operands: bool = True
    widen_16bit: bool = False
    dw_as_bits: bool = False

    def tile_dtype(self, dtype) -> jnp.dtype:
        dtype = jnp.dtype(dtype)
        return jnp.dtype(jnp.float32) if self.widen_16bit and dtype.itemsize == 2 else dtype

    def dw_tile(self, h_t, du, weight_layout):
        return hm.matmul(lax.optimization_barrier(h_t.T), du, (1, 0))  # h^T du [H, C]

    def dw_chunk_shape(self, shape, weight_layout):
        return shape if weight_layout == "hv" else shape[::-1]  # [H, C] either way

    def dw_hidden_dim(self, weight_layout):
        return 0  # [H, C] either way

    def dw_buffer(self, w, weight_layout) -> sc.DwBuffer:
        axis = layout.vocab_dim(weight_layout)
        return _BitsDwBuffer(w, axis) if self.dw_as_bits else _CpuDwBuffer(w, axis)


def make_plan(config: XlaCpuConfig | None, spec: HeadSpec) -> tuple[xla.XlaPlan, int]:
    """``xla.make_plan`` with the ``CpuTuning`` that ``config`` and ``spec`` call for."""
    config = config or XlaCpuConfig()
    narrow = jnp.dtype(spec.dtype).itemsize == 2
    native = cpu_has_bf16_matmul() if config.bf16_matmul is None else config.bf16_matmul
    dw_bytes = math.prod(spec.local_weight_shape) * 2
    tuning = CpuTuning(widen_16bit=narrow and not native,
                       dw_as_bits=narrow and dw_bytes <= config.dw_bits_max_bytes)
    return xla.make_plan(config, spec, tuning)


#: ``impl="xla_cpu"``: ``"xla"`` with ``CpuTuning`` (``XlaCpuConfig``).
XLA_CPU = Implementation(XlaCpuConfig, make_plan, xla.chunked_head)
