"""Sharded HF checkpoint import (``models.load_params`` on a mesh): every process reads
only the file slices its devices hold, and the arrays equal the whole-file load bit for bit
(8 devices in one process: MoE and dense, unrolled and stacked layers, the MoE's experts
also fused as transformers 5 holds them, default and odd rules, float32 and bfloat16
parameters; 2 processes x 2 devices through the trainer's
``train.rl.state.load_hf``). The export back from those 2 processes (``models.save_params``):
each writes its own shards, moving one layer at a time, and the files equal the original
ones."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from models.hf import _Tensor
from tests.models.checkpoint_cases import write_checkpoints
from tests.support.multidevice import run_case, run_multiprocess


@pytest.mark.parametrize("lead, n_in, shape", [
    (0, None, (6, 4)),  # embedding / norm: the file layout
    (0, 1, (4, 3, 2)),  # q_proj [H, N, D]: file [N*D, H]
    (0, 2, (3, 2, 4)),  # o_proj [N, D, H]: file [H, N*D]
    (1, 1, (3, 4, 5)),  # experts [E, H, I]: E files [I, H]
    (2, 2, (2, 3, 2, 2, 3)),  # stacked layers x experts, two input axes
])
def test_read_maps_a_block_to_file_slices(lead, n_in, shape):
    rng = np.random.default_rng(0)
    value = rng.standard_normal(shape).astype(np.float32)
    keys = tuple(f"t{i}" for i in range(int(np.prod(shape[:lead]))))
    t = _Tensor(keys, n_in, lead)
    files = dict(zip(keys, t.to_hf(value), strict=True))
    reads = []

    def get(key, index):
        reads.append(int(files[key][index].size))
        return files[key][index]

    for _ in range(30):
        cuts = [sorted(rng.choice(n + 1, 2, replace=False)) for n in shape]
        index = tuple(slice(int(a), int(b)) for a, b in cuts)
        reads.clear()
        np.testing.assert_array_equal(t.read(get, shape, index), value[index])
        assert sum(reads) == value[index].size  # nothing read twice or beyond the block
    full = tuple(slice(None) for _ in shape)
    reads.clear()
    np.testing.assert_array_equal(t.read(get, shape, full), value)
    assert len(reads) == len(keys)  # a whole parameter: one read per file tensor


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_sharded")
    write_checkpoints(root)
    return str(root)


def test_sharded_load_equals_whole_file_load_on_8_devices(checkpoints):
    out = run_case("tests.models.checkpoint_cases:single_process_case", devices=8,
                   CHECKPOINTS=checkpoints)
    assert len(out) == 20
    for name, r in out.items():
        assert r["mismatched"] == [], name
        if "bytes_read" in r:
            assert r["sharded"] >= r["params"] - 4, name  # all but a few norms split
            assert r["bytes_read"] == r["shard_bytes"], name  # each distinct slice once


def test_two_processes_read_only_their_own_slices(checkpoints):
    outs = run_multiprocess("tests.models.checkpoint_cases:two_process_case", processes=2,
                            devices_per_process=2, CHECKPOINTS=checkpoints)
    assert [o["process"] for o in outs] == [0, 1] and outs[0]["processes"] == 2
    for o in outs:
        assert o["mismatched"] == [] and o["placed"]
        assert o["bytes_read"] == o["shard_bytes"] < 0.6 * o["file_bytes"]
        # the embedding's file layout is ours: the slices read are the slices held
        assert sorted(map(tuple, o["embed_reads"])) == sorted(map(tuple, o["embed_held"]))
    for key in ("embed_reads", "head_reads"):
        mine, theirs = ([tuple(map(tuple, w)) for w in o[key]] for o in outs)
        assert mine and theirs
        for a, b in itertools.product(mine, theirs):  # no element read by both
            assert any(x1 <= y0 or y1 <= x0 for (x0, x1), (y0, y1) in zip(a, b)), (key, a, b)

    # the export from the two processes: shards split between them, tensors as written
    # by one process; a stacked parameter moves one layer (of 2) at a time, nothing moves
    # more than the embedding (a sixth of the model here)
    root = Path(checkpoints)
    index = json.loads((root / "export-2p" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert outs[0]["written"] and outs[1]["written"]
    assert sorted(outs[0]["written"] + outs[1]["written"]) == files
    assert all(f in outs[i % 2]["written"] for i, f in enumerate(files))
    for o in outs:
        stacked = [(n, of) for unit, n, of in o["units"] if unit is not None]
        assert stacked and all(2 * n == of for n, of in stacked)
        assert max(n for _, n, _ in o["units"]) < 0.2 * o["file_bytes"]
    exported = {k: v for f in files for k, v in load_file(root / "export-2p" / f).items()}
    original = {k: v for f in (root / "moe-scan").glob("*.safetensors")
                for k, v in load_file(f).items()}
    assert exported.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)
