"""End to end: ``python -m train.grpo`` on the micro config (SFT stage, evals, 2 GRPO
steps), SIGKILL + resume, and clear errors for bad input.

The runs share a persistent XLA compilation cache (one directory for every pytest-xdist
worker), so later runs of the same shapes skip most compiles.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT
from tests.support.multidevice import device_env

MICRO = str(ROOT / "configs" / "grpo_micro.py")
TRAIN_KEYS = {
    "reward_mean", "reward_std", "accuracy", "zero_std_group_fraction",
    "completion_length_mean", "kl", "clip_fraction", "entropy", "grad_norm", "lr",
    "lm_head_token_fraction", "logprob_diff_mean", "logprob_diff_max", "tokens_per_s",
    "mfu", "peak_memory_bytes", "time_rollout_s", "time_reference_s", "time_train_s",
    "sampling_path",
}


@pytest.fixture(scope="session")
def env(tmp_path_factory):
    cache = tmp_path_factory.getbasetemp().parent / "jax_compilation_cache"
    # device_env's CASE_FLAGS (LLVM optimisation off) halve the runs' compile time; these
    # checks compare runs compiled alike, or with tolerances, never the default flags' bits
    return device_env(1, JAX_COMPILATION_CACHE_DIR=str(cache),
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")


def _cmd(workdir, *overrides):
    return [sys.executable, "-m", "train.grpo", f"--config={MICRO}",
            f"--config.workdir={workdir}", *overrides]


def _records(workdir):
    return [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").read_text()
            .splitlines()]


def _complete_checkpoints(directory):
    return sorted(int(p.name) for p in Path(directory).iterdir() if p.name.isdigit())


def test_two_grpo_steps_end_to_end(tmp_path, env):
    work = tmp_path / "run"
    # beta > 0: the reference forward and the KL metric run too; 2 epochs x 2 mini-batches
    # with the trainer's old log-probs: 4 updates per step, reported one by one
    updates = ("--config.loss.beta=0.01", "--config.train.updates_per_batch=2",
               "--config.train.mini_batches=2", "--config.loss.old_logprobs=trainer")
    out = subprocess.run(_cmd(work, *updates, f"--config.export.hf_dir={work / 'hf'}"),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "before GRPO: 16 held-out problems" in out.stdout
    assert "after GRPO: 16 held-out problems" in out.stdout
    assert "| sampled reward (T=1) |" in out.stdout and "| greedy accuracy |" in out.stdout
    recs = _records(work)
    train = [r for r in recs if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert TRAIN_KEYS <= set(r), TRAIN_KEYS - set(r)
        assert 0 < r["lm_head_token_fraction"] < 0.5
        assert r["logprob_diff_max/1.1"] <= 1e-4  # before the first update: the sampler's
        assert r["sampling_path"] == "chunked_gumbel_max"
        per_update = {f"{k}/{e}.{m}" for k in ("clip_fraction", "ratio_max", "approx_kl_old")
                      for e in (1, 2) for m in (1, 2)}
        assert per_update <= set(r), per_update - set(r)
        assert abs(r["ratio_max/1.1"] - 1) <= 1e-4  # before any update: the trainer's own
    assert {r["kind"] for r in recs} == {"sft", "eval_before", "train", "eval_greedy",
                                         "eval_after"}
    curve = [r for r in recs if r["kind"] == "eval_greedy"]  # eval.curve_every = 1
    assert [(r["step"], r["problems"]) for r in curve] == [(1, 8), (2, 8)]
    assert all(0 <= r["greedy_accuracy"] <= 1 for r in curve)
    assert _complete_checkpoints(work / "grpo")[-1] == 2
    assert (work / "tb").is_dir()
    # the banner, before anything else
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"train.grpo: config {MICRO}, run directory {work}")
    assert lines[1].startswith("devices: 1 x cpu in 1 process(es), mesh data=1")
    assert lines[2].startswith("model: preset tiny, 4.87M parameters") and "width 32" in lines[2]
    assert lines[3].startswith("task: chain_sum") and "16 held-out problems" in lines[3]
    assert "SFT 2 steps x 8 sequences, then GRPO 2 steps x 2 prompts x 4 samples" in lines[3]
    # the run's GRPO curve: a PNG in the run directory, or how to get one without matplotlib
    import importlib.util

    plot_line = lines[-1]
    if importlib.util.find_spec("matplotlib"):
        assert plot_line == f"plot: {work / 'grpo_curve.png'}"
        assert (work / "grpo_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert plot_line.startswith("plot: matplotlib is not installed; pip install")
    # progress bars of the held-out evaluations (tqdm, on stderr; not "100%": tqdm shows a
    # step only mininterval = 0.1 s after the last, and the bar is cleared when it closes)
    assert "eval before:   0%" in out.stderr and "eval after:   0%" in out.stderr
    # retention: GRPO keeps its latest checkpoint (checkpoint.keep=1), the finished SFT
    # stage its final parameters only
    assert _complete_checkpoints(work / "grpo") == [2]
    assert {p.name for p in (work / "grpo" / "2").iterdir() if p.is_dir()} == {
        "params", "opt_state", "rng", "meta"}
    assert _complete_checkpoints(work / "sft") == [2]
    assert {p.name for p in (work / "sft" / "2").iterdir() if p.is_dir()} == {"params", "meta"}
    check_export(work, work / "hf")
    # the run directory keeps its config; a value that changes the results stops a rerun
    # before any work (the reported case: a finished run printed T=0.5 above its T=1 rows)
    assert json.loads((work / "config.json").read_text())["loss.beta"] == "0.01"
    hotter = subprocess.run(
        _cmd(work, *updates, "--config.rollout.temperature=0.5"), cwd=ROOT,
        env=env, capture_output=True, text=True, timeout=300, check=False)
    assert hotter.returncode == 2 and hotter.stderr.startswith(
        "error: rollout.temperature = 0.5, but the run was started with 1.0"), hotter.stderr
    # a finished params-only stage cannot be resumed to more steps: one line, no traceback
    more = subprocess.run(_cmd(work, *updates, "--config.sft.steps=3"),
                          cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert more.returncode == 1 and "Traceback" not in more.stderr
    assert more.stderr.startswith(f"error: {work / 'sft'} finished at step 2 and kept its "
                                  "final parameters only")
    # rerunning the finished run trains nothing, says so, and writes no metrics line
    again = subprocess.run(_cmd(work, *updates), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0, again.stderr[-3000:]
    for stage in ("sft", "grpo"):
        assert f"{stage}: finished earlier (2 steps); using its final checkpoint" in again.stdout
    assert _records(work) == recs


def check_export(run, out):
    """The run's final policy as a Hugging Face directory (``export.hf_dir``): transformers'
    logits equal ours (float32, 1e-5) and its tokenizer (the offline Qwen BPE converted)
    encodes texts and its chat template the prompt as the trainer does (the run's
    ``<answer>`` prefill included)."""
    import numpy as np

    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from tests.support.models import causal_inputs, hf_logits
    from train.data.tasks import answer_prefix
    from train.data.tokenizer import load_tokenizer
    from train.rl import state
    from train.run import resume, setup
    from train.run.checkpoint import require_checkpoint

    cfg = resume.saved_config(run)
    mdef = state.ModelDef.of(setup.run_model_config(cfg))
    ckpt = require_checkpoint(run / "grpo")
    model = mdef.merge(ckpt.restore({"params": mdef.abstract_params()})[0]["params"])
    ckpt.close()
    tok = load_tokenizer(cfg.tokenizer)
    prompt = tok.chat_prompt(cfg.data.system_prompt, "What is 12 + 7?")
    tokens = np.asarray([prompt])
    ours = np.asarray(model.logits(model(*causal_inputs(tokens)).hidden))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert np.abs(hf_logits(hf, tokens) - ours).max() <= 1e-5
    auto = transformers.AutoTokenizer.from_pretrained(out)
    chat = auto.apply_chat_template([{"role": "user", "content": "What is 12 + 7?"}],
                                    tokenize=False, add_generation_prompt=True)
    prefill = tok.encode(answer_prefix(cfg.data.prefill_answer_tag))
    assert prefill and auto(chat, add_special_tokens=False)["input_ids"] == prompt + prefill
    for text in ("  x = 1234567 +\n\t-89", "Ünïcödé café 日本語 🙂", "don't WE'LL"):
        assert auto(text, add_special_tokens=False)["input_ids"] == tok.encode(text), text


def test_sigkill_then_rerun_resumes_without_loss_or_duplicates(tmp_path, env):
    work = tmp_path / "run"
    args = ("--config.train.steps=6", "--config.checkpoint.every=2",
            "--config.checkpoint.keep=10", "--config.eval.before_after=False")
    proc = subprocess.Popen(_cmd(work, *args), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = work / "metrics.jsonl"
    deadline = time.monotonic() + 500
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and any(
                    r["kind"] == "train" and r["step"] >= 3 for r in _records(work)):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    written = metrics.read_bytes()
    complete_before = _complete_checkpoints(work / "grpo")
    assert complete_before and complete_before[-1] >= 2

    out = subprocess.run(_cmd(work, *args), cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"grpo: resuming from checkpoint step {complete_before[-1]}" in out.stdout
    final = metrics.read_bytes()
    cut = written[: written.rfind(b"\n") + 1]  # a line the kill cut short is dropped
    assert final.startswith(cut), "lines written before the kill changed"
    keys = [(r["kind"], r["step"]) for r in _records(work)]
    assert len(keys) == len(set(keys)), "duplicated metrics lines"
    assert [s for k, s in keys if k == "train"] == [1, 2, 3, 4, 5, 6]
    after = _complete_checkpoints(work / "grpo")
    assert set(complete_before) <= set(after) and after[-1] == 6
    assert not [p for p in (work / "grpo").iterdir() if "tmp" in p.name]


def test_unknown_config_key_lists_valid_keys(tmp_path, env):
    out = subprocess.run(_cmd(tmp_path / "w", "--config.optim.lr=1e-5"), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2
    assert "unknown config key(s) ['optim.lr']" in out.stderr
    first = out.stderr.strip().splitlines()[0]
    assert "did you mean" in first and "'train.optim.lr'" in first  # the closest keys
    assert "train.optim.lr" in out.stderr and "loss.beta" in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: unknown config key(s)")


@pytest.mark.parametrize("override, message", [
    ({"data.tasks": ("chain_sum", "no_such_task")},
     "data.tasks = ('chain_sum', 'no_such_task'): unknown name(s) 'no_such_task'"),
    ({"init.sft_checkpoint": "MISSING"}, "must be '' or an existing directory"),
    ({"model.hf_checkpoint": "MISSING"}, "must be '' or an existing directory"),
])
def test_bad_input_exits_with_a_clear_error(tmp_path, capsys, override, message):
    from train.config.cli import load_config
    from train.run import setup

    cfg = load_config(MICRO)
    for key, value in override.items():
        section, name = key.split(".")
        cfg[section][name] = (value.replace("MISSING", str(tmp_path / "missing"))
                              if isinstance(value, str) else value)
    cfg.workdir = str(tmp_path / "w")
    with pytest.raises(SystemExit) as exc:
        setup.start(cfg)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err


def test_hf_checkpoint_is_read_into_the_placement(tmp_path):
    """``model.hf_checkpoint``: ``setup.build`` reads the checkpoint into the placement's
    shardings (``train.rl.state.load_hf``) and ``initial_params`` starts from exactly it."""
    import numpy as np

    from models import save_model
    from tests.support.models import random_model
    from train.config.cli import load_config
    from train.rl import state
    from train.run import setup

    cfg = load_config(MICRO)
    model = random_model(setup.model_config(cfg), seed=2)
    save_model(model, tmp_path / "hf")
    cfg.model.hf_checkpoint = str(tmp_path / "hf")
    cfg.workdir = str(tmp_path / "w")
    cfg.metrics.tensorboard = False  # (its import pulls in torch)
    s = setup.build(cfg)
    params, expected = setup.initial_params(cfg, s), state.params_of(model)
    assert params.keys() == expected.keys() == s.placement.params.keys()
    for key, value in params.items():
        assert value.sharding == s.placement.params[key], key
        np.testing.assert_array_equal(np.asarray(value), np.asarray(expected[key]), key)
