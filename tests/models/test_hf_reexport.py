"""An export owns its directory (``models.save_params``, ``models.export_dir``): exporting
again into one directory, in any order of one file / shards + index and float32 /
bfloat16, leaves exactly the newest export, which ``load_model``, transformers and a reader
that looks for the index first (as vLLM does) all read; a directory holding anything else
is refused unless replacing it is asked for; a failed export leaves the previous one whole.

Source: issue 42, item 1 ("re-export keeps stale weights"), replaying converter bug reports
where a second ``save_pretrained`` of another layout into the same directory left the first
one's shards and index behind: an index-first loader then read the old weights (24 of 24
tensors of a 3-shard export overwritten by a one-file one)."""

from __future__ import annotations

import itertools
import json

import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from models import get_config, load_model, save_model
from models.export_dir import INDEX_FILE, MARK
from models.hf import hf_tensors
from tests.support.models import random_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: export kind -> (max_shard_bytes, dtype); 150 kB cuts the tied "tiny" model (24 tensors,
#: 377 kB in float32) into 3 shards, 2 in bfloat16
KINDS = {"one-file-f32": (5 * 2**30, "float32"), "sharded-f32": (150_000, "float32"),
         "one-file-bf16": (5 * 2**30, "bfloat16"), "sharded-bf16": (150_000, "bfloat16")}


@pytest.fixture(scope="module")
def models():
    """Two random tied "tiny" models: the first export and the newer one."""
    cfg = get_config("tiny", dtype="float32")
    return random_model(cfg, seed=1), random_model(cfg, seed=2)


def index_first(path) -> dict[str, np.ndarray]:
    """The tensors a loader that reads the index first sees (vLLM's
    ``weight_utils``: the files ``model.safetensors.index.json`` names when it exists,
    else the single ``model.safetensors``), as float32."""
    from safetensors.torch import load_file

    index = path / INDEX_FILE
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else ["model.safetensors"])
    return {k: v.float().numpy() for f in files for k, v in load_file(path / f).items()}


def expected(model, dtype: str) -> dict[str, np.ndarray]:
    """The model's HF tensors rounded to ``dtype``, as float32."""
    tensors = hf_tensors(model.cfg, nnx.state(model, nnx.Param))
    np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    return {k: v.astype(np_dtype).astype(np.float32) for k, v in tensors.items()}


def assert_holds_exactly(out, model, kind: str) -> None:
    """``out`` holds the export of ``model`` as ``kind`` and nothing else, and every
    reader gets its weights."""
    shard_bytes, dtype = KINDS[kind]
    want = expected(model, dtype)
    index = out / INDEX_FILE
    names = (set(json.loads(index.read_text())["weight_map"].values()) | {INDEX_FILE}
             if index.exists() else {"model.safetensors"})
    assert index.exists() == (shard_bytes < 2**20)
    assert sorted(p.name for p in out.iterdir()) == sorted(names | {"config.json"})
    assert not list(out.parent.glob(f".{out.name}.*"))  # no staging left beside it
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["dtype"] == hf_config["torch_dtype"] == dtype

    got = index_first(out)
    assert got.keys() == want.keys()
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=f"index-first reader: {key}")

    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    state = {k: v.float().numpy() for k, v in theirs.state_dict().items()}
    for key, value in want.items():
        np.testing.assert_array_equal(state[key], value, err_msg=f"transformers: {key}")

    ours = load_model(out, dtype="float32")
    again = hf_tensors(ours.cfg, nnx.state(ours, nnx.Param))
    for key, value in want.items():
        np.testing.assert_array_equal(again[key], value, err_msg=f"load_model: {key}")


@pytest.mark.parametrize("first, second", list(itertools.permutations(KINDS, 2)))
def test_export_over_an_export_leaves_only_the_newest(models, tmp_path, first, second):
    out = tmp_path / "hf"
    old, new = models
    save_model(old, out, max_shard_bytes=KINDS[first][0], dtype=KINDS[first][1])
    if first.startswith("sharded"):
        assert len(list(out.glob("*.safetensors"))) == (3 if first.endswith("f32") else 2)
    save_model(new, out, max_shard_bytes=KINDS[second][0], dtype=KINDS[second][1])
    assert_holds_exactly(out, new, second)


def test_a_directory_holding_anything_else_is_refused_unless_replaced(models, tmp_path,
                                                                     monkeypatch):
    """A run directory, a transformers checkpoint or any other non-empty directory is not
    an export's to delete: refused before anything is written, replaced when asked."""
    old, new = models
    out = tmp_path / "hf"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"'.*/hf' is not empty and holds no previous "
                                              r"export.*'notes\.txt'.*replace=True"):
        save_model(new, out)
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging directory either
    assert [p.name for p in out.iterdir()] == ["notes.txt"]

    base = tmp_path / "base"  # a checkpoint transformers wrote: no export's mark
    save_model(old, out, replace=True)
    transformers.AutoModelForCausalLM.from_pretrained(out).save_pretrained(base)
    with pytest.raises(FileExistsError, match="holds no previous export"):
        save_model(new, base)
    save_model(new, base, replace=True, max_shard_bytes=150_000)
    assert_holds_exactly(base, new, "sharded-f32")

    file = tmp_path / "a-file"
    file.write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        save_model(new, file)
    with (pytest.raises(ValueError, match="is or holds the working directory"),
          monkeypatch.context() as patch):
        patch.chdir(out)
        save_model(new, tmp_path, replace=True)


def test_a_failed_export_leaves_the_previous_one_whole(models, tmp_path):
    old, new = models
    out = tmp_path / "hf"
    save_model(old, out, max_shard_bytes=150_000)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def fail(directory):
        assert (directory / "config.json").exists() and directory != out
        raise OSError("disk full")

    from models import save_params

    params = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(new, nnx.Param))}
    with pytest.raises(OSError, match="disk full"):
        save_params(params, new.cfg, out, add_files=fail)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert_holds_exactly(out, old, "sharded-f32")


def test_every_tensor_has_the_dtype_config_json_names(models, tmp_path):
    """``config.json`` names the tensors' dtype as ``dtype`` (transformers 5) and
    ``torch_dtype`` (older readers), equal to every tensor's dtype in the files.

    Source: issue 42, item 4 ("config.json lacks dtype"), from serving-stack reports where
    a reader following transformers 5 found no ``dtype`` and fell back to float32."""
    from safetensors import safe_open

    _, new = models
    for dtype, tag in (("bfloat16", "BF16"), ("float32", "F32")):
        out = tmp_path / dtype
        save_model(new, out, dtype=dtype, max_shard_bytes=150_000)
        hf_config = json.loads((out / "config.json").read_text())
        assert hf_config["dtype"] == hf_config["torch_dtype"] == dtype
        for file in out.glob("*.safetensors"):
            with safe_open(file, framework="np") as f:
                assert f.metadata() == MARK
                assert {f.get_slice(k).get_dtype() for k in f.keys()} == {tag}  # noqa: SIM118
        loaded = transformers.AutoConfig.from_pretrained(out)
        assert loaded.dtype == getattr(torch, dtype)
    with pytest.raises(ValueError, match="export dtype 'float16': float32 or bfloat16 only"):
        save_model(new, tmp_path / "f16", dtype="float16")
    with pytest.raises(ValueError, match=r"metadata sets \['dtype'\]"):
        save_model(new, tmp_path / "clash", metadata={"dtype": "float16"})
