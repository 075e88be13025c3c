"""``python -m train.export``: a run directory's checkpoint as a Hugging Face directory that
transformers loads with our logits (float32, 1e-5), for each family, dense and MoE; its
generation config and tokenizer files; clear errors. The trainer's own export at the end
of a run (``export.hf_dir``, with the offline Qwen BPE converted) is checked by
``tests/train/test_e2e.py``; the multi-process write by ``tests/models/test_hf_sharded.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from absl import flags
from safetensors import safe_open

from models import get_config
from tests.support import ROOT
from tests.support.models import LLAMA3_ROPE, causal_inputs, hf_logits, random_model
from train import export
from train.rl import state
from train.run import resume, setup
from train.run.checkpoint import Checkpointer
from train.run.schema import base_config

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

#: name -> (preset, overrides): one of each family, the MoE stacked (scan_layers)
RUNS = {
    "qwen3-moe": ("tiny-moe", {"scan_layers": True}),
    "qwen2": ("tiny", {"qk_norm": False, "qkv_bias": True}),
    "llama": ("tiny", {"qk_norm": False, "rope_scaling": LLAMA3_ROPE,
                       "tie_word_embeddings": False}),
}


def write_tokenizer(directory) -> None:
    """A small word-level ``tokenizer.json`` with the ChatML and end-of-text specials."""
    import tokenizers
    from tokenizers import models, pre_tokenizers

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system",
             "\n", *map(str, range(10)), "+", "="]
    tok = tokenizers.Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)},
                                                unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(words[:3])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))


def write_run(root, name: str) -> tuple:
    """A run directory as the trainer leaves it (``config.json``, a GRPO checkpoint at step
    3) of a random model; returns ``(run, model)``."""
    preset, overrides = RUNS[name]
    cfg = base_config()
    cfg.workdir = str(root / name)
    cfg.model.preset = preset
    cfg.model.overrides = overrides
    cfg.tokenizer = str(root / "tokenizer")
    cfg.rollout.top_k = 20
    cfg.rollout.temperature = 0.7
    cfg.data.system_prompt = "Be brief."
    write_tokenizer(root / "tokenizer")
    run = root / name
    resume.save(cfg, run)
    model = random_model(setup.run_model_config(cfg), seed=4)
    ckpt = Checkpointer(run / setup.GRPO_DIR, every=1, keep=1)
    ckpt.save(3, {"params": state.params_of(model)}, {"step": 3, "data_position": 0})
    ckpt.close()
    return run, model


@pytest.mark.parametrize("name", list(RUNS))
def test_export_loads_in_transformers_with_our_logits(tmp_path, name):
    run, model = write_run(tmp_path, name)
    out = export.export_run(run, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager").float().eval()
    tokens = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (2, 12))
    ours = np.asarray(model.logits(model(*causal_inputs(tokens)).hidden))
    err = np.abs(hf_logits(hf, tokens) - ours).max()
    print(f"\n{name} ({type(hf).__name__}): max|logits| {np.abs(ours).max():.2f}, err {err:.1e}")
    assert err <= 1e-5
    assert type(hf).__name__ == {"qwen3-moe": "Qwen3MoeForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "llama": "LlamaForCausalLM"}[name]
    assert json.loads((out / "generation_config.json").read_text()) == {
        "eos_token_id": [2, 0], "pad_token_id": 0, "do_sample": True, "temperature": 0.7,
        "top_p": 1.0, "top_k": 20}
    assert (out / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer/tokenizer.json"
                                                     ).read_bytes()
    generation = transformers.GenerationConfig.from_pretrained(out)
    assert generation.eos_token_id == [2, 0] and generation.top_k == 20


def test_cli_exports_a_step_in_bfloat16(tmp_path):
    run, _ = write_run(tmp_path, "qwen2")
    out = subprocess.run(
        [sys.executable, "-m", "train.export", f"--run={run}", f"--out={tmp_path / 'hf'}",
         "--step=3", "--dtype=bfloat16"], cwd=ROOT, capture_output=True, text=True,
        timeout=300, check=False, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode == 0 and out.stdout.strip() == f"wrote {tmp_path / 'hf'}", out.stderr
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="np") as f:
        bias = f.get_slice("model.layers.0.self_attn.q_proj.bias")
        assert bias.get_dtype() == "BF16" and bias.get_shape() == [64]
    assert json.loads((tmp_path / "hf/config.json").read_text())["torch_dtype"] == "bfloat16"


def test_errors_name_the_run_and_the_model(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a run directory: no config.json"):
        export.export_run(tmp_path, tmp_path / "hf")
    run, _ = write_run(tmp_path, "llama")
    with pytest.raises(FileNotFoundError, match=r"no step 1; its steps: \[3\]"):
        export.export_run(run, tmp_path / "hf", step=1)
    flags.FLAGS(["export", f"--run={run}", f"--out={tmp_path / 'hf'}", "--step=1"])
    try:  # the command: one line, no traceback
        with pytest.raises(SystemExit, match=r"^error: .*/llama/grpo has no step 1; its steps"):
            export.main(["export"])
    finally:
        flags.FLAGS.unparse_flags()
    with pytest.raises(FileNotFoundError, match=r"directory '.*/llama/sft' does not exist"):
        export.export_run(run, tmp_path / "hf", stage="sft")
    with pytest.raises(FileNotFoundError, match=r"has no checkpoint \(no grpo/ or sft/"):
        export.latest_stage(tmp_path / "tokenizer")
    capped = random_model(get_config("tiny", final_logit_softcapping=30.0))
    mdef = state.ModelDef.of(capped.cfg)
    cfg = resume.saved_config(run)
    with pytest.raises(ValueError, match="no final-logit soft-cap"):
        export.export_params(cfg, mdef, state.params_of(capped), tmp_path / "capped")


def test_a_directory_holding_something_else_is_refused_before_the_run(tmp_path):
    """``train.export`` and the trainer's ``export.hf_dir`` write a directory only when it
    is missing, empty or a previous export, else ask for ``--replace`` /
    ``export.replace``; the trainer checks before the run starts, not after it trained.

    Source: issue 42, item 1 (an export replaces its directory whole, so one pointed at a
    run directory or a base checkpoint must be refused, not merged into)."""
    run, _ = write_run(tmp_path, "llama")
    out = export.export_run(run, tmp_path / "hf")
    export.export_run(run, out, dtype="bfloat16")  # a previous export: replaced
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    with pytest.raises(FileExistsError, match=r"'.*/tokenizer' is not empty and holds no "
                                              r"previous export.*'tokenizer\.json'"):
        export.export_run(run, tmp_path / "tokenizer")
    with pytest.raises(ValueError, match=r"is or holds the run directory"):
        export.export_run(run, tmp_path, replace=True)  # the checkpoint it reads
    cfg = resume.saved_config(run)
    cfg.export.hf_dir = str(run)
    with pytest.raises(FileExistsError, match=r"'.*/llama' is not empty.*'config\.json', "
                                              r"'grpo'.*export.replace=True"):
        export.check_destination(cfg)
    cfg.export.replace = True
    export.check_destination(cfg)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    export.export_run(run, tmp_path / "mine", replace=True)
    assert not (tmp_path / "mine" / "notes.txt").exists()
    assert (tmp_path / "mine" / "tokenizer.json").exists()
