"""How one of our parameters lies in a Hugging Face checkpoint: the ``Tensor`` record (its
key or stacked keys, transposed / head-split / flattened layout) and the slice arithmetic
that reads one block of it (a device's shard) from the files without reading the rest.

HF linear weights are ``[out, in]``; ours are ``[in..., out...]`` with the head dimensions
split (``q_proj`` ``[H, N, D]``, ``o_proj`` ``[N, D, H]``); stacked layers (``[L]``) and
experts (``[E]``) are one key each in the files, in row-major order of those axes.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np


def index_ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[range]:
    """``index`` (one ``slice`` per axis of ``shape``, as ``jax.make_array_from_callback``
    passes) as one ``range`` per axis, with a step of 1.

    Raises:
      ValueError: a strided slice (the index and the shape named).
    """
    out = [range(*s.indices(n)) for s, n in zip(index, shape, strict=True)]
    if any(r.step != 1 for r in out):
        raise ValueError(f"strided index {index} of an array of shape {shape}")
    return out


def _runs(ranges: list[range], shape: tuple[int, ...]) -> list[slice]:
    """The contiguous runs, in row-major order, of the flat (row-major) positions that the
    block ``ranges`` of an array of ``shape`` covers: one run when every axis after the
    first partly taken one is whole (e.g. heads split, ``head_dim`` whole), else one per
    index of the axes before the last partly taken one."""
    cut = max((k for k, (r, n) in enumerate(zip(ranges, shape)) if len(r) != n), default=-1)
    if cut < 0:
        return [slice(0, math.prod(shape))]
    strides = [math.prod(shape[k + 1:]) for k in range(len(shape))]
    out = []
    for outer in itertools.product(*ranges[:cut]):
        base = sum(i * s for i, s in zip(outer, strides))
        out.append(slice(base + ranges[cut].start * strides[cut],
                         base + ranges[cut].stop * strides[cut]))
    return out


@dataclasses.dataclass(frozen=True)
class Tensor:
    """How one of our parameters is stored: HF key(s), and for kernels how many axes of
    ours (after the stacked ones) are input axes (HF stores ``[prod(out), prod(in)]``).
    Several keys are stacked on our ``lead`` leading axes (layers and / or experts), in
    row-major order of those axes. ``flat``: stored as one vector (a bias ``[N, D]`` as
    ``[N*D]``)."""

    keys: tuple[str, ...]
    n_in: int | None = None
    lead: int = 0
    flat: bool = False

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of each of ``keys`` in the files, for our parameter's ``shape``."""
        inner = shape[self.lead:]
        if self.flat:
            return (math.prod(inner),)
        if self.n_in is None:
            return tuple(inner)
        return (math.prod(inner[self.n_in:]), math.prod(inner[:self.n_in]))

    def read(self, get, shape: tuple[int, ...], index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of our ``shape``-d parameter, in the file dtype.

        Reads exactly the file slices the block needs through ``get(key, hf_index)``
        (``hf_index`` a tuple of ``slice`` s of the HF tensor ``key``): the stacked keys
        the leading ranges select, and of each the rows / columns the inner ranges map to
        (the block of a transposed, head-split kernel is one rectangle of the HF ``[out,
        in]`` matrix unless a split axis follows a partly taken one, e.g. ``head_dim``
        sharded, then several).
        """
        ranges = index_ranges(index, shape)
        lead, inner = shape[:self.lead], shape[self.lead:]
        outer, within = ranges[:self.lead], ranges[self.lead:]
        strides = [math.prod(lead[k + 1:]) for k in range(self.lead)]
        keys = [self.keys[sum(i * s for i, s in zip(pos, strides))]
                for pos in itertools.product(*outer)]
        parts = []
        for key in keys:
            if self.flat:
                block = np.concatenate([get(key, (r,)) for r in _runs(within, inner)])
                parts.append(block.reshape([len(r) for r in within]))
                continue
            if self.n_in is None:
                parts.append(get(key, tuple(slice(r.start, r.stop) for r in within)))
                continue
            rows = _runs(within[self.n_in:], inner[self.n_in:])
            cols = _runs(within[:self.n_in], inner[:self.n_in])
            block = np.concatenate([np.concatenate([get(key, (r, c)) for c in cols], axis=1)
                                    for r in rows])
            parts.append(block.T.reshape([len(r) for r in within]))
        return np.stack(parts).reshape([len(r) for r in ranges]) if self.lead else parts[0]

    def to_hf(self, value: np.ndarray) -> list[np.ndarray]:
        """Our ``value`` (or the part of it that ``keys`` cover: one unit of a stacked
        parameter, see ``models.hf.save_params``) as the files' C-contiguous tensors, one
        per key, in the order of ``keys``."""
        parts = list(value.reshape(-1, *value.shape[self.lead:])) if self.lead else [value]
        if self.flat:
            parts = [p.reshape(-1) for p in parts]
        elif self.n_in is not None:
            parts = [p.reshape(math.prod(p.shape[:self.n_in]), -1).T for p in parts]
        return [np.ascontiguousarray(p) for p in parts]
