"""transformers 5's fused experts, read as the per-expert keys the families name.

transformers 5 holds a MoE layer's experts as a few stacked tensors under
``model.layers.{i}.mlp.experts`` (for Qwen3-MoE ``gate_up_proj`` ``[E, 2I, H]`` and
``down_proj`` ``[E, H, I]``); a family declares that layout (``Family.fused_experts``) and
the import maps each per-expert key (``...mlp.experts.{e}.gate_proj.weight``) onto rows of
the fused tensor, so one reader serves both layouts.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np

from models.config import ModelConfig
from models.hf.family import CheckpointError, Family

#: A tensor directly under a layer's experts: (``model.layers.{i}.mlp.experts``, name).
_UNDER_EXPERTS = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.([A-Za-z_]+)")


@dataclasses.dataclass(frozen=True)
class FusedExpert:
    """Where a per-expert key (``...experts.{e}.gate_proj.weight``, ``[I, H]``) lies in a
    fused tensor: ``fused[expert, offset:offset + rows, :]``."""

    key: str
    expert: int
    offset: int

    def read(self, handle, index: tuple[slice, slice]) -> np.ndarray:
        """The block ``index`` (rows, columns of the per-expert matrix) of the expert,
        read through ``handle`` (a ``safe_open`` handle of the fused tensor's file)."""
        rows, cols = index
        block = (slice(self.expert, self.expert + 1),
                 slice(rows.start + self.offset, rows.stop + self.offset), cols)
        return handle.get_slice(self.key)[block][0]


def fused_names(family: Family, cfg: ModelConfig) -> tuple[str, ...]:
    """The fused tensors' names under a layer's ``mlp.experts`` for ``family`` (none when it
    declares no fused layout or ``cfg`` has no experts)."""
    if family.fused_experts is None or not cfg.num_experts:
        return ()
    return tuple(family.fused_experts(cfg))


def fused_experts(family: Family, cfg: ModelConfig, handles,
                  key_files: dict[str, Path]) -> dict[str, FusedExpert]:
    """Per-expert key -> its place in a fused tensor, for every fused expert tensor of the
    files in ``family``'s layout (``Family.fused_experts``), its shape checked against
    ``cfg``.

    Args:
      family, cfg: the checkpoint's family and the model's config.
      handles: file -> open ``safe_open`` handle; key_files: tensor key -> file.

    Raises:
      CheckpointError: a fused tensor of the wrong shape (key, file, both shapes named),
        or experts stored both fused and per expert (both keys named).
    """
    if not fused_names(family, cfg):
        return {}
    layout = family.fused_experts(cfg)
    out = {}
    for key, file in key_files.items():
        match = _UNDER_EXPERTS.fullmatch(key)
        if not match or match[2] not in layout:
            continue
        prefix, name = match.groups()
        shape, parts = layout[name]
        found = tuple(handles[file].get_slice(key).get_shape())
        if found != shape:
            raise CheckpointError(f"{file}: fused experts tensor {key!r} has shape {found}, "
                                  f"expected {shape} from config.json")
        for e in range(cfg.num_experts):
            for proj, offset in parts:
                alias = f"{prefix}.{e}.{proj}.weight"
                if alias in key_files:
                    raise CheckpointError(f"{file}: experts stored both fused and one by one: "
                                          f"{key!r} and {alias!r}")
                out[alias] = FusedExpert(key, e, offset)
    return out
