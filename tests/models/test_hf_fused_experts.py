"""Qwen3-MoE checkpoints whose experts are fused as transformers 5 holds them
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``)
import as the per-expert layout does, one file or shards, whole or slice by slice; the
export writes the per-expert layout; a missing, mis-shaped or doubly stored expert tensor
is an error naming it.

Source: issue 42, item 3 ("transformers 5's fused MoE layout is refused"), from converter
and trainer reports of Qwen3-MoE checkpoints written with transformers 5's in-memory expert
names, which transformers loads and which raised ``CheckpointError`` (48 missing) here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy

from models import CheckpointError, load_model, save_model
from models.hf import _Fused
from tests.support.models import causal_inputs, hf_logits, hf_model, random_tokens

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def write_fused(model, path, shards: int = 1) -> dict[str, np.ndarray]:
    """``model`` (a transformers Qwen3-MoE) saved under its in-memory names (the fused
    experts), in ``shards`` files with an index when more than one; returns the tensors."""
    tensors = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in tensors)  # transformers 5's layout
    model.config.architectures = [type(model).__name__]  # as save_pretrained sets it
    model.config.save_pretrained(path)
    keys = sorted(tensors)
    if shards == 1:
        safetensors_numpy.save_file(tensors, path / "model.safetensors", {"format": "pt"})
        return tensors
    names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
    weight_map = {k: names[i * shards // len(keys)] for i, k in enumerate(keys)}
    for name in names:
        part = {k: tensors[k] for k in keys if weight_map[k] == name}
        safetensors_numpy.save_file(part, path / name, {"format": "pt"})
    total = sum(v.nbytes for v in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tensors


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """``(transformers model, one-file fused checkpoint, per-expert checkpoint)``."""
    model = hf_model(moe=True, tied=False, num_hidden_layers=3, mlp_only_layers=[1])
    root = tmp_path_factory.mktemp("fused")
    write_fused(model, root / "fused")
    model.save_pretrained(root / "per-expert")
    return model, root / "fused", root / "per-expert"


def params_of(model):
    from flax import nnx

    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.mark.parametrize("shards", [1, 3])
def test_fused_experts_import_as_transformers_loads_them(fused, tmp_path, shards):
    hf, _, per_expert = fused
    path = tmp_path / "fused"
    path.mkdir()
    write_fused(hf, path, shards)
    tokens = random_tokens((2, 16), seed=9)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32).eval()
    state = theirs.state_dict()
    for key, value in hf.state_dict().items():  # transformers reads every tensor
        np.testing.assert_array_equal(state[key].numpy(), value.numpy(), err_msg=key)
    ref = hf_logits(theirs, tokens)

    model = load_model(path, dtype="float32")
    ours = np.asarray(model.logits(model(*causal_inputs(tokens)).hidden))
    err = np.abs(ours - ref).max()
    print(f"\nfused, {shards} file(s): max|logits| {np.abs(ref).max():.2f}, err {err:.1e}")
    assert err <= 1e-5
    reference = params_of(load_model(per_expert, dtype="float32"))
    got = params_of(model)
    assert got.keys() == reference.keys()
    for key, value in reference.items():
        np.testing.assert_array_equal(got[key], value, err_msg=str(key))


def test_export_of_a_fused_import_is_per_expert(fused, tmp_path):
    """The one layout the export writes: per expert, which transformers 4 and 5 and vLLM's
    Qwen3-MoE loader read; bit for bit what transformers itself saves."""
    _, path, per_expert = fused
    save_model(load_model(path, dtype="float32"), tmp_path / "out")
    exported = safetensors_numpy.load_file(tmp_path / "out" / "model.safetensors")
    original = safetensors_numpy.load_file(per_expert / "model.safetensors")
    assert not [k for k in exported if k.endswith(("gate_up_proj", "experts.down_proj"))]
    assert exported.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(exported[key], value, err_msg=key)


def test_read_of_an_expert_block_takes_the_fused_rows():
    """A slice of one expert (as a device of a mesh asks for) is the same rows and
    columns of the fused tensor, the up rows after the gate ones."""
    rng = np.random.default_rng(0)
    e, i, h = 3, 5, 4
    gate_up = rng.standard_normal((e, 2 * i, h)).astype(np.float32)

    class Handle:
        def get_slice(self, key):
            assert key == "k"
            return gate_up

    for expert, offset, rows in ((0, 0, slice(0, 5)), (2, i, slice(1, 4)), (1, i, slice(4, 5))):
        block = _Fused("k", expert, offset).read(Handle(), (rows, slice(1, 3)))
        want = gate_up[expert, offset:offset + i][rows, 1:3]
        np.testing.assert_array_equal(block, want)


def rewrite(path, dst, edit) -> None:
    dst.mkdir()
    (dst / "config.json").write_bytes((path / "config.json").read_bytes())
    tensors = safetensors_numpy.load_file(path / "model.safetensors")
    edit(tensors)
    safetensors_numpy.save_file(tensors, dst / "model.safetensors", {"format": "pt"})


def test_bad_fused_experts_raise_naming_the_tensor(fused, tmp_path):
    _, path, _ = fused
    gate_up = "model.layers.2.mlp.experts.gate_up_proj"

    def refused(name, edit, match):
        rewrite(path, tmp_path / name, edit)
        with pytest.raises(CheckpointError, match=match):
            load_model(tmp_path / name)

    refused("missing", lambda t: t.pop(gate_up),
            r"missing tensor 'model\.layers\.2\.mlp\.experts\.0\.gate_proj\.weight' .*or "
            r"fused as model\.layers\.2\.mlp\.experts\.gate_up_proj.*16 missing in all")

    def gate_only(t):
        t[gate_up] = np.ascontiguousarray(t[gate_up][:, :32])
    refused("gate-only", gate_only,
            r"fused experts tensor 'model\.layers\.2\.mlp\.experts\.gate_up_proj' has shape "
            r"\(8, 32, 64\), expected \(8, 64, 64\)")

    def both(t):
        t["model.layers.2.mlp.experts.3.up_proj.weight"] = t[gate_up][3, 32:]
    refused("both", both,
            r"both fused and one by one: 'model\.layers\.2\.mlp\.experts\.gate_up_proj' and "
            r"'model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight'")

    def on_a_dense_layer(t):
        t["model.layers.1.mlp.experts.down_proj"] = t["model.layers.0.mlp.experts.down_proj"]
    refused("dense", on_a_dense_layer,
            r"1 tensor\(s\) that config.json does not account for"
            r".*layers\.1\.mlp\.experts\.down_proj")
