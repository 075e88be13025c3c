"""A model family is one record in ``models.hf.families.FAMILIES``: adding one (here a
renamed copy of Llama's) makes its checkpoints load and export with no other change.

Source: issue 43, item 4 (``models/hf/``: one record per family; "A model family" in the
"How to add" list of docs/layout.md).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pytest
from flax import nnx
from safetensors import numpy as safetensors_numpy

from models import CheckpointError, load_model, save_model
from models.hf import config_from_hf, families
from models.hf.families import llama
from tests.support.models import causal_inputs, hf_logits, hf_model, random_tokens

pytest.importorskip("torch")
pytest.importorskip("transformers")

#: A family transformers does not know: Llama's record under another name.
RENAMED = dataclasses.replace(llama.FAMILY, architecture="RenamedLlamaForCausalLM",
                              model_type="renamed_llama")


def params_of(model):
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def tensors_of(path):
    out = {}
    for file in path.glob("*.safetensors"):
        out.update(safetensors_numpy.load_file(file))
    return out


@pytest.fixture
def renamed_checkpoint(tmp_path):
    """``(transformers Llama, its checkpoint, the same with config.json naming RENAMED)``."""
    hf = hf_model(moe=False, tied=False, family="llama")
    hf.save_pretrained(tmp_path / "llama")
    shutil.copytree(tmp_path / "llama", tmp_path / "renamed")
    config = json.loads((tmp_path / "renamed" / "config.json").read_text())
    config.update(architectures=[RENAMED.architecture], model_type=RENAMED.model_type)
    (tmp_path / "renamed" / "config.json").write_text(json.dumps(config))
    return hf, tmp_path / "llama", tmp_path / "renamed"


def test_a_family_added_to_the_list_loads_and_exports(renamed_checkpoint, tmp_path,
                                                      monkeypatch):
    """Unknown before it is listed (the error lists the families); once first in
    ``FAMILIES``, its checkpoint loads to transformers' logits and exports under its own
    architecture and model type with the tensors bit for bit; the export loads back to the
    same parameters."""
    hf, original, renamed = renamed_checkpoint
    with pytest.raises(CheckpointError, match=r"unsupported architecture "
                                              r"'RenamedLlamaForCausalLM' \(model_type "
                                              r"'renamed_llama'\); supported: Qwen3ForCausalLM"):
        load_model(renamed, dtype="float32")

    monkeypatch.setattr(families, "FAMILIES", (RENAMED, *families.FAMILIES))
    with pytest.raises(CheckpointError, match=r"supported: RenamedLlamaForCausalLM "
                                              r"\(renamed_llama\), Qwen3ForCausalLM"):
        config_from_hf({"architectures": ["MistralForCausalLM"], "model_type": "mistral"})
    model = load_model(renamed, dtype="float32")
    tokens = random_tokens((2, 16), seed=7)
    logits = np.asarray(model.logits(model(*causal_inputs(tokens)).hidden))
    assert np.abs(logits - hf_logits(hf, tokens)).max() <= 1e-4

    save_model(model, tmp_path / "export")
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["architectures"] == [RENAMED.architecture]
    assert config["model_type"] == RENAMED.model_type
    assert config["rope_parameters"]["rope_type"] == "llama3"
    want, got = tensors_of(original), tensors_of(tmp_path / "export")
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    again = params_of(load_model(tmp_path / "export", dtype="float32"))
    before = params_of(model)
    assert again.keys() == before.keys()
    for key in before:
        np.testing.assert_array_equal(again[key], before[key], err_msg=str(key))


def test_a_record_with_a_field_the_config_lacks_is_refused():
    """A family's fixed fields are ``ModelConfig`` fields and its layer a tuple of pieces;
    anything else is refused when the record is made, naming it."""
    with pytest.raises(ValueError, match=r"RenamedLlamaForCausalLM: fixed fields "
                                         r"\['sliding_window'\] are not ModelConfig fields"):
        dataclasses.replace(RENAMED, fixed={"qk_norm": False, "sliding_window": 4096})
    with pytest.raises(ValueError, match=r"layer must be a tuple of pieces"):
        dataclasses.replace(RENAMED, layer=llama.FAMILY.layer[0])
