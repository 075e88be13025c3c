"""The directory a Hugging Face export owns (``models.save_params``).

An export is written into a staging directory beside its destination
(``.<name>.export-staging``, on the same file system) and moved into place only once
complete, replacing the destination whole: no weight file, index or other file of what was
there before survives it, whatever the layouts (one file or shards plus an index) and
dtypes of the two. A loader that reads the index first (vLLM, ``models.load_model``) and
one that reads ``model.safetensors`` first (transformers) then see the same, newest
weights.

What may be replaced without asking: a missing or empty directory, or a previous export,
recognised by the mark every weight file of an export carries in its safetensors header
(``MARK``; transformers and vLLM ignore header fields other than ``format``). Anything
else (a run directory, a base checkpoint, an export written before the mark existed) is
refused unless the caller asks to replace it.

The move is two renames (the old directory aside, the new one in its place), then the old
one is deleted: a crash between them leaves the old export beside the destination, named
``.<name>.export-replaced``, and the next export removes it and any left-over staging.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors import safe_open

INDEX_FILE = "model.safetensors.index.json"
#: The safetensors header fields of every weight file an export writes.
MARK = {"format": "pt", "writer": "jaxhead models.save_params"}


def staging_dir(path: Path) -> Path:
    """Where the export to ``path`` is written before it is moved into place."""
    return path.with_name(f".{path.name}.export-staging")


def _replaced_dir(path: Path) -> Path:
    return path.with_name(f".{path.name}.export-replaced")


def weight_files(path: Path) -> list[Path]:
    """The weight files a loader of ``path`` reads: those the index names, else every
    ``*.safetensors`` file."""
    index = path / INDEX_FILE
    if index.exists():
        return sorted({path / name for name in json.loads(index.read_text())["weight_map"]
                       .values()})
    return sorted(path.glob("*.safetensors"))


def is_export(path: Path) -> bool:
    """Whether ``path`` is a directory written by a previous export: a ``config.json``
    and weight files that all carry ``MARK`` (an unreadable one counts as not)."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return False
    try:
        files = weight_files(path)
        for file in files:
            with safe_open(file, framework="np") as f:
                if (f.metadata() or {}).get("writer") != MARK["writer"]:
                    return False
    except Exception:  # noqa: BLE001 (a missing or corrupt file or index: not ours)
        return False
    return bool(files)


def check_destination(path, *, replace: bool = False) -> None:
    """Raise unless an export may write ``path``: it is missing, an empty directory or a
    previous export (``is_export``), or ``replace`` is set (then anything there is
    deleted when the new export is complete).

    Raises:
      FileExistsError: ``path`` is a file, or a non-empty directory that is no previous
        export (the message names it, a few of its entries and how to replace it).
      ValueError: ``path`` is the working directory or holds it (replacing it would
        leave this process without one), ``replace`` or not.
    """
    path = Path(path).absolute()
    if path.exists() and Path.cwd().resolve().is_relative_to(path.resolve()):
        raise ValueError(f"export destination {str(path)!r} is or holds the working "
                         "directory, which the export would replace; choose a directory "
                         "beside it")
    if replace or not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"export destination {str(path)!r} is a file; pass "
                              "replace=True (train.export: --replace) to replace it")
    entries = sorted(p.name for p in path.iterdir())
    if entries and not is_export(path):
        raise FileExistsError(
            f"export destination {str(path)!r} is not empty and holds no previous export "
            f"(weight files carrying {MARK['writer']!r}); its entries include "
            f"{entries[:4]}; pass replace=True (train.export: --replace, the trainer: "
            "export.replace=True) to replace all of it, or choose another directory")


def prepare(path: Path) -> Path:
    """The empty staging directory of ``path`` (left-overs of an earlier export to
    ``path`` removed). Called by one process."""
    staging = staging_dir(path)
    for stale in (staging, _replaced_dir(path)):
        shutil.rmtree(stale, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def commit(path: Path) -> None:
    """Move the complete staging directory of ``path`` into place, replacing whatever is
    at ``path`` (a directory whole, or a file). Called by one process."""
    replaced = _replaced_dir(path)
    if path.is_dir() and not path.is_symlink():
        path.rename(replaced)
    elif path.exists() or path.is_symlink():
        path.unlink()
    staging_dir(path).rename(path)
    shutil.rmtree(replaced, ignore_errors=True)


def discard(path: Path) -> None:
    """Remove the staging directory of ``path`` (an export that failed); what is at
    ``path`` is untouched."""
    shutil.rmtree(staging_dir(path), ignore_errors=True)
