"""The safetensors files of a checkpoint directory: which file holds which tensor (the
index or the files' headers), and whether they hold exactly the tensors a config needs."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from models.export_dir import INDEX_FILE
from models.hf.family import CheckpointError
from models.hf.fused import FusedExpert


def tensor_files(path: Path) -> dict[str, Path]:
    """Tensor key -> safetensors file, from ``model.safetensors.index.json`` or, without
    one, from the headers of every ``*.safetensors`` file of ``path``.

    Raises:
      CheckpointError: no weight files, or a key in two files (both named).
    """
    index = path / INDEX_FILE
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {key: path / name for key, name in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {INDEX_FILE}")
    out = {}
    for file in files:
        with safe_open(file, framework="np") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                if key in out:
                    raise CheckpointError(f"tensor {key!r} is in both {out[key]} and {file}")
                out[key] = file
    return out


def check_tensors(path: Path, handles, key_files: dict[str, Path],
                  expected: dict[str, tuple[int, ...]], fused: dict[str, FusedExpert],
                  fused_names: tuple[str, ...] = ()) -> None:
    """Raise unless the files hold exactly the ``expected`` keys with these shapes (read
    from the files' headers only), an expert's either itself or in a fused tensor.

    Args:
      path: the checkpoint directory (for the messages).
      handles: file -> open ``safe_open`` handle; key_files: tensor key -> file.
      expected: tensor key -> its shape from the config.
      fused: per-expert key -> its place in a fused tensor (``models.hf.fused``).
      fused_names: the family's fused expert tensors, named in the hint of a missing
        expert's key.

    Raises:
      CheckpointError: a missing tensor (key, expected shape, how many are missing), one
        of another shape (key, file, both shapes), or tensors the config does not account
        for (a few named).
    """
    missing = [key for key in expected if key not in key_files and key not in fused]
    if missing:
        first = missing[0]
        hint = ""
        if ".mlp.experts." in first and fused_names:
            prefix = first.split(".mlp.experts.")[0]
            hint = " or fused as " + " / ".join(f"{prefix}.mlp.experts.{name}"
                                                for name in fused_names)
        raise CheckpointError(
            f"{path}: missing tensor {first!r} (expected shape {expected[first]} "
            f"from config.json{hint}); {len(missing)} missing in all"
        )
    for key, shape in expected.items():
        if key in fused:
            continue  # the fused tensor's shape is checked by models.hf.fused
        found = tuple(handles[key_files[key]].get_slice(key).get_shape())
        if found != shape:
            raise CheckpointError(f"{key_files[key]}: tensor {key!r} has shape {found}, "
                                  f"expected {shape} from config.json")
    used = {f.key for alias, f in fused.items() if alias in expected}
    extra = sorted(set(key_files) - set(expected) - used)
    if extra:
        raise CheckpointError(
            f"{path}: {len(extra)} tensor(s) that config.json does not account for, "
            f"e.g. {extra[:3]}"
        )
