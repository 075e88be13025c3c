"""A run directory remembers the config it was started with (``config.json``: every key of
the schema as the ``repr`` of its value), so that a rerun that resumes it can be checked
against it: a value that changes the results (``resume=SAME`` in ``train.run.schema``) stops
the run; more steps (``EXTENDS``) and how the run is carried out (``FREE``: checkpoint and
log intervals, mesh, processes) are allowed and listed."""

from __future__ import annotations

import ast
import json
import os
from pathlib import Path

from train.config.domains import EXTENDS, FREE, keys, value_at
from train.run import schema as schema_config

FILE = "config.json"


def snapshot(cfg) -> dict[str, str]:
    """Every key of the schema and the ``repr`` of its value in ``cfg``."""
    return {key: repr(value_at(cfg, key)) for key in keys(schema_config.schema())}


def save(cfg, workdir: Path) -> None:
    """Write ``cfg``'s snapshot to ``workdir/config.json`` (atomically)."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_atomic(workdir / FILE, json.dumps(snapshot(cfg), indent=1) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through ``<path>.tmp`` and a rename, so that a run killed
    mid-write leaves the old file or the new one, never a partial one."""
    tmp = path.with_name(f"{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def saved_config(workdir):
    """The config ``workdir`` was started with, rebuilt from its ``config.json`` (a key
    the file lacks, added to the schema later, keeps its default).

    Raises:
      FileNotFoundError: no ``config.json`` in ``workdir`` (not a run directory).
    """
    path = Path(workdir) / FILE
    if not path.is_file():
        raise FileNotFoundError(f"{workdir} is not a run directory: no {FILE}")
    saved = json.loads(path.read_text())
    cfg = schema_config.base_config()
    for key in keys(schema_config.schema()):
        if key in saved:
            *parents, leaf = key.split(".")
            section = cfg
            for part in parents:
                section = section[part]
            section[leaf] = ast.literal_eval(saved[key])
    return cfg


def differences(saved: dict[str, str], cfg) -> tuple[list[str], list[str]]:
    """``(allowed, refused)``: one line per key whose value differs from ``saved``.

    A key ``saved`` lacks (added to the schema after the run started) counts as changed
    only when its value is not the default; a key that ``EXTENDS`` may grow, not shrink."""
    allowed, refused = [], []
    for key, spec in keys(schema_config.schema()).items():
        now = repr(value_at(cfg, key))
        then = saved.get(key, repr(spec.default))
        if now == then:
            continue
        if spec.resume == FREE:
            allowed.append(f"{key} {then} -> {now}")
        elif spec.resume == EXTENDS and int(now) > int(then):
            allowed.append(f"{key} {then} -> {now} (extends the run)")
        else:
            refused.append(f"{key} = {now}, but the run was started with {then}")
    return allowed, refused


def check(cfg, workdir: Path) -> list[str]:
    """The allowed differences between ``cfg`` and the config ``workdir`` was started
    with (empty for a new run, or one started before runs kept their config).

    Raises:
      ValueError: one line per value that would change the results, and what to do.
    """
    path = workdir / FILE
    if not path.is_file():
        return []
    allowed, refused = differences(json.loads(path.read_text()), cfg)
    if refused:
        raise ValueError("\n".join(
            f"{line} (in {workdir}: resume with the saved value, or start a new run with "
            f"another --config.workdir)" for line in refused))
    return allowed
