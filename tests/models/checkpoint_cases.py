"""Multi-device cases of the sharded HF checkpoint import (``models.load_params``), run by
``tests.support.multidevice`` (``tests/models/test_hf_sharded.py``). The tiny checkpoints
are written by the pytest process (``write_checkpoints``) into the directory named by
``$CHECKPOINTS``; every read from the files goes through ``ReadLog``, which records the
slices requested.
"""

from __future__ import annotations

import os
from pathlib import Path
from unittest import mock

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from models import get_config, hf, load_model, make_mesh, save_model, save_params
from tests.support.models import random_model

#: Checkpoint name -> (preset, scan_layers, max_shard_bytes): MoE and dense (tied), each
#: unrolled and stacked; one written as several files with an index; one MoE with its
#: experts fused as transformers 5 holds them (``FUSED``).
CHECKPOINTS = {
    "moe": ("tiny-moe", False, 5 * 2**30),
    "moe-fused": ("tiny-moe", False, 5 * 2**30),
    "moe-scan": ("tiny-moe", True, 60_000),
    "dense": ("tiny", False, 5 * 2**30),
    "dense-scan": ("tiny", True, 5 * 2**30),
}
#: Rules that shard what the default ones do not: the stacked layers (on ``fsdp``),
#: ``head_dim`` with the heads whole (a kernel slice is then several runs of file rows or
#: columns), the experts on ``tensor``.
ODD_RULES = (("layers", "fsdp"), ("expert", "tensor"), ("embed", "fsdp"), ("vocab", "tensor"),
             ("head_dim", "tensor"), ("mlp", "tensor"))
#: (mesh sizes, rules or None for the defaults) of the single-process case (8 devices).
MESHES = (({"fsdp": 2, "expert": 4}, None), ({"fsdp": 2, "tensor": 4}, ODD_RULES))
#: The mesh of the two-process case (2 processes x 2 devices).
TWO_PROCESS_MESH = {"fsdp": 2, "expert": 2}
TWO_PROCESS_CHECKPOINT = "moe-scan"
FUSED = "moe-fused"


def model_config(name: str, param_dtype: str = "float32"):
    preset, scan, _ = CHECKPOINTS[name]
    return get_config(preset, dtype="float32", param_dtype=param_dtype, scan_layers=scan)


def write_checkpoints(root) -> None:
    """Every ``CHECKPOINTS`` entry as ``root/<name>``: a random float32 model saved by
    ``models.save_model``, ``FUSED``'s experts then rewritten as ``experts.gate_up_proj``
    ``[E, 2I, H]`` and ``experts.down_proj`` ``[E, H, I]``."""
    for name, (_, _, shard_bytes) in CHECKPOINTS.items():
        save_model(random_model(model_config(name), seed=11), Path(root) / name,
                   max_shard_bytes=shard_bytes)
    file = Path(root) / FUSED / "model.safetensors"
    tensors, cfg = load_file(file), model_config(FUSED)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}.mlp.experts."
        stack = {proj: np.stack([tensors.pop(f"{pre}{e}.{proj}.weight")
                                 for e in range(cfg.num_experts)])
                 for proj in ("gate_proj", "up_proj", "down_proj")}
        tensors[f"{pre}gate_up_proj"] = np.concatenate([stack["gate_proj"], stack["up_proj"]],
                                                       axis=1)
        tensors[f"{pre}down_proj"] = stack["down_proj"]
    save_file(tensors, file, {"format": "pt"})


class ReadLog:
    """A stand-in for ``safe_open`` (patched into ``models.hf``) that records every slice
    read: ``reads`` holds ``(key, ((start, stop) per axis), nbytes)``. Handles have no
    ``get_tensor``: a whole-tensor read other than through a slice fails."""

    def __init__(self):
        self.reads: list[tuple[str, tuple[tuple[int, int], ...], int]] = []

    def __call__(self, file, framework):
        return _Handle(safe_open(file, framework=framework), self.reads)

    def bytes_read(self) -> int:
        return sum(n for _, _, n in self.reads)


class _Handle:
    def __init__(self, handle, reads):
        self._handle, self._reads = handle, reads

    def __enter__(self):
        self._handle.__enter__()
        return self

    def __exit__(self, *exc):
        return self._handle.__exit__(*exc)

    def keys(self):
        return self._handle.keys()

    def get_slice(self, key):
        return _Slice(self._handle.get_slice(key), key, self._reads)


class _Slice:
    def __init__(self, view, key, reads):
        self._view, self._key, self._reads = view, key, reads

    def get_shape(self):
        return self._view.get_shape()

    def __getitem__(self, index):
        value = self._view[index]
        shape = self._view.get_shape()
        where = tuple(s.indices(n)[:2] for s, n in zip(index, shape, strict=True))
        self._reads.append((self._key, where, value.nbytes))
        return value


def _flat(model) -> dict[tuple, jax.Array]:
    return {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def _mismatches(loaded: dict, whole: dict) -> list[str]:
    """Parameters whose addressable shards differ (values, dtype) from the whole arrays."""
    bad = []
    for p, arr in loaded.items():
        ref = np.asarray(whole[p])
        ok = arr.dtype == ref.dtype and arr.shape == ref.shape and all(
            np.array_equal(np.asarray(s.data), ref[s.index]) for s in arr.addressable_shards)
        if not ok:
            bad.append(str(p))
    return bad


def _distinct_elements(loaded: dict) -> int:
    """Elements of this process's distinct shards (replicas counted once)."""
    total = 0
    for arr in loaded.values():
        where = {tuple(s.indices(n)[:2] for s, n in zip(sh.index, arr.shape, strict=True))
                 for sh in arr.addressable_shards}
        total += sum(int(np.prod([b - a for a, b in w])) for w in where)
    return total


def single_process_case() -> dict:
    """8 devices: every checkpoint on each of ``MESHES`` (float32, and bfloat16 params on
    the first) equals the whole-file load and the saved model bit for bit; the slices read
    add up to the distinct shards' bytes."""
    root = Path(os.environ["CHECKPOINTS"])
    out = {}
    for name in CHECKPOINTS:
        scan = model_config(name).scan_layers
        saved = _flat(random_model(model_config(name), seed=11))
        whole = _flat(load_model(root / name, dtype="float32", scan_layers=scan))
        runs = [(sizes, rules, "float32") for sizes, rules in MESHES]
        runs.append((*MESHES[0], "bfloat16"))
        for sizes, rules, dtype in runs:
            log = ReadLog()
            with mock.patch.object(hf, "safe_open", log):
                loaded = _flat(load_model(root / name, dtype="float32", param_dtype=dtype,
                                          scan_layers=scan, mesh=make_mesh(sizes),
                                          rules=rules))
            ref = whole if dtype == "float32" else {
                p: np.asarray(v).astype(jax.numpy.bfloat16) for p, v in whole.items()}
            out[f"{name} {sizes} {dtype}"] = {
                "mismatched": _mismatches(loaded, ref),
                "sharded": sum(not a.sharding.is_fully_replicated for a in loaded.values()),
                "params": len(loaded),
                "bytes_read": log.bytes_read(),
                "shard_bytes": 4 * _distinct_elements(loaded),  # float32 files
            }
        out[f"{name} whole-file vs saved"] = {"mismatched": _mismatches(whole, saved)}
    return out


def two_process_case() -> dict:
    """One of 2 processes x 2 devices (``TWO_PROCESS_MESH``): the trainer's import
    (``train.rl.state.load_hf`` into ``Placement.params``) of ``TWO_PROCESS_CHECKPOINT``.
    Returns whether this process's shards equal the whole-file load (on its own first
    device), the bytes it read against its distinct shards' and the whole files', and the
    file slices it requested of the embedding and the (transposed) LM head with the
    slices its devices hold."""
    from train.rl import state
    from train.rl.placement import Placement
    from train.run.distributed import initialize_distributed

    initialize_distributed()
    path = Path(os.environ["CHECKPOINTS"]) / TWO_PROCESS_CHECKPOINT
    cfg = model_config(TWO_PROCESS_CHECKPOINT)
    whole = {state.param_key(p): v
             for p, v in _flat(load_model(path, dtype="float32", scan_layers=True)).items()}
    mdef = state.ModelDef.of(cfg)
    placement = Placement(make_mesh(TWO_PROCESS_MESH), mdef)
    log = ReadLog()
    with mock.patch.object(hf, "safe_open", log):
        loaded = state.load_hf(path, mdef, placement.params)
    # and back: each process writes its own shards, gathering one layer at a time
    units = []

    def gather(x, unit, dtype, _gather=hf._gather):  # (layer index or None, bytes, of bytes)
        value = _gather(x, unit, dtype)
        units.append((unit, value.nbytes, int(np.prod(x.shape)) * value.itemsize))
        return value

    out_dir = Path(os.environ["CHECKPOINTS"]) / "export-2p"
    with mock.patch.object(hf, "_gather", gather):
        written = save_params({p: loaded[state.param_key(p)] for p in mdef.paths}, cfg,
                              out_dir, max_shard_bytes=60_000)
    held = {key: sorted({tuple(s.indices(n)[:2] for s, n in zip(sh.index, arr.shape,
                                                                  strict=True))
                         for sh in arr.addressable_shards})
            for key, arr in loaded.items()}
    return {
        "process": jax.process_index(), "processes": jax.process_count(),
        "mismatched": _mismatches(loaded, whole),
        "placed": all(loaded[k].sharding == placement.params[k] for k in loaded),
        "bytes_read": log.bytes_read(), "shard_bytes": 4 * _distinct_elements(loaded),
        "file_bytes": sum(4 * v.size for v in whole.values()),
        "embed_reads": [w for k, w, _ in log.reads if k == "model.embed_tokens.weight"],
        "embed_held": held["embed_tokens.embedding"],
        "head_reads": [w for k, w, _ in log.reads if k == "lm_head.weight"],
        "head_held": held["lm_head.kernel"],
        "written": sorted(f.name for f in written), "units": units,
    }
