"""A config is checked before any work: one bad value per key of the schema gives one
``error: key = value: reason`` line, exit status 2 and an untouched run directory; every
bad key is reported at once; a resumed run whose config changes the results stops, while
more steps and how the run is carried out are allowed and listed."""

from __future__ import annotations

import json
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from tests.support import ROOT
from train.config.cli import load_config
from train.config.domains import keys
from train.rl import optim, rl_loss, updates
from train.rl.rollout_settings import RolloutSettings
from train.run import experience, resume, setup
from train.run import schema as config

MICRO = str(ROOT / "configs" / "grpo_micro.py")
OPTIM_BAD = {"lr": 0.0, "warmup_steps": -1, "decay": "exponential", "end_lr_ratio": 1.5,
             "b1": 1.0, "b2": -0.1, "eps": 0.0, "weight_decay": -0.01, "clip_norm": 0.0,
             "frozen": ("embed_tokens", ""), "lr_multipliers": (("norm", 0.0),)}
ROWS_BAD = {"row_len": 1, "row_multiple": 0, "bucket_multiple": 0}
#: One value outside its domain for every key (MISSING: a directory that does not exist).
BAD = {
    "workdir": "", "seed": -1, "tokenizer": "MISSING",
    "model.preset": "no-such-preset", "model.hf_checkpoint": "MISSING",
    "model.dtype": "float64", "model.param_dtype": "int8",
    "model.overrides": {"hidden_size": -32},
    "data.tasks": ("chain_sum", "no_such_task"),
    "data.task_kwargs": {"basic_arithmetic": {"min_terms": 2}},
    "data.train_seed": -1, "data.eval_seed": -2, "data.max_prompt_len": 0,
    "data.format_reward": -0.1,
    "sft.steps": -1, "sft.task_kwargs": {"basic_arithmetic": {"min_terms": 2}},
    "sft.batch_size": 0, "sft.log_every": 0, "sft.max_nonfinite_updates": 0,
    **{f"sft.{k}": v for k, v in ROWS_BAD.items()},
    **{f"sft.optim.{k}": v for k, v in OPTIM_BAD.items()},
    "init.sft_checkpoint": "MISSING",
    "rollout.prompts_per_step": 0, "rollout.group_size": 1, "rollout.max_new_tokens": 0,
    "rollout.temperature": 0.0, "rollout.top_k": -1, "rollout.top_p": 0.0,
    "rollout.min_p": 1.0, "rollout.engine": "fast", "rollout.decode_chunk": 0,
    "rollout.page_size": 0, "rollout.max_decode_rows": -1,
    "loss.advantage": "ppo", "loss.negative_weight": 1.5, "loss.eps_low": 1.0,
    "loss.eps_high": -0.2, "loss.beta": -0.01, "loss.kl_estimator": "k4",
    "loss.entropy_coef": float("nan"), "loss.aggregation": "sum",
    "loss.logprob_support": "top_p", "loss.tis_cap": -1.0, "loss.mask_ratio_low": 1.0,
    "loss.mask_ratio_high": 0.5, "loss.old_logprobs": "reference", "loss.clip_ratio_c": 0.9,
    "loss.ratio_level": "group",
    "train.updates_per_batch": 0, "train.mini_batches": 0, "train.micro_batches": 0,
    "train.steps": -1, "train.log_every": 0, "train.max_nonfinite_updates": 0,
    **{f"train.{k}": v for k, v in ROWS_BAD.items()},
    **{f"train.optim.{k}": v for k, v in OPTIM_BAD.items()},
    "checkpoint.every": 0, "checkpoint.keep": 0,
    "eval.size": 0, "eval.samples": 0, "eval.batch": -1, "eval.curve_every": -1,
    "eval.curve_size": 0,
    "metrics.peak_flops": -1.0,
    "export.dtype": "float16",
    "mesh.data": 0, "mesh.fsdp": -2, "mesh.expert": 0, "mesh.context": 0, "mesh.tensor": 0,
    "mesh.rules": (("embed", "nope"),),
    "distributed.coordinator_address": "localhost", "distributed.num_processes": -1,
    "distributed.process_id": -2,
}
#: Keys every value of whose type is valid (the config's types are enforced on assignment).
ANY_VALUE = {"data.system_prompt", "model.remat", "data.prefill_answer_tag",
             "data.stop_at_close_tag", "train.skip_unkept", "eval.before_after",
             "metrics.tensorboard", "distributed.enabled", "export.hf_dir",
             "export.replace", "loss.routing_replay"}


def _set(cfg, key: str, value) -> None:
    *sections, name = key.split(".")
    node = cfg
    for s in sections:
        node = node[s]
    node[name] = value


def _start(cfg, capsys) -> tuple[int, list[str]]:
    """``setup.start(cfg)``'s exit status and stderr lines (it must exit)."""
    with pytest.raises(SystemExit) as exc:
        setup.start(cfg)
    return exc.value.code, capsys.readouterr().err.strip().splitlines()


def test_every_key_has_a_bad_value_in_the_table():
    assert set(BAD) | ANY_VALUE == set(keys(config.schema()))
    assert not set(BAD) & ANY_VALUE


def test_every_config_file_checks_clean():
    for path in sorted((ROOT / "configs").glob("*.py")):
        if path.name == "__init__.py":
            continue
        problems = config.check(load_config(str(path)))
        if path.name in ("grpo_qwen3_0p6b.py", "grpo_qwen3_30b_a3b.py",  # need a checkpoint
                         "grpo_qwen2p5_1p5b.py"):
            assert len(problems) == 1 and "--config.model.hf_checkpoint=DIR" in problems[0]
        else:
            assert problems == [], (path.name, problems)


@pytest.mark.parametrize("key", sorted(BAD))
def test_one_bad_value_is_one_error_line_exit_2_and_nothing_written(key, tmp_path, capsys):
    cfg = load_config(MICRO)
    value = BAD[key]
    if value == "MISSING":
        value = str(tmp_path / "missing")
    _set(cfg, key, value)
    if key != "workdir":
        cfg.workdir = str(tmp_path / "run")
    status, lines = _start(cfg, capsys)
    assert status == 2
    assert len(lines) == 1 and lines[0].startswith(f"error: {key} = "), lines
    assert ": must be " in lines[0] or "unknown name" in lines[0] or key.startswith(
        ("model.", "data.task_kwargs", "sft.task_kwargs")), lines[0]
    assert not (tmp_path / "run").exists()


def test_keys_that_contradict_each_other_are_named(tmp_path, capsys):
    cfg = load_config(MICRO)
    cfg.workdir = str(tmp_path / "run")
    cfg.mesh.fsdp = -1  # beside data=-1
    status, lines = _start(cfg, capsys)
    assert status == 2 and lines == [
        "error: mesh.fsdp = -1: at most one mesh axis may be -1, got ['data', 'fsdp']"]
    assert not (tmp_path / "run").exists()


def test_updates_that_round_away_are_refused_before_any_work(tmp_path, capsys):
    """The reported case: the 30B preset shipped ``param_dtype = "bfloat16"`` with
    ``lr = 1e-6``; 0.4% of the weights ever moved. The optimizer now keeps float32 masters
    of 16-bit parameters (issue 42 item 6, ``tests/train/test_optim.py``), so that config
    trains and passes; a rate below float32's spacing is refused, naming the rate."""
    cfg = load_config(str(ROOT / "configs" / "grpo_qwen3_30b_a3b.py"))
    assert cfg.model.param_dtype == "float32" and cfg.model.dtype == "bfloat16"
    cfg.model.param_dtype = "bfloat16"
    assert not [p for p in config.check(cfg) if "round" in p]
    cfg = load_config(MICRO)
    cfg.workdir = str(tmp_path / "run")
    cfg.model.param_dtype = "bfloat16"
    cfg.train.optim.lr, cfg.sft.optim.lr = 1e-8, 1e-4  # below float32's spacing at 1.0
    status, lines = _start(cfg, capsys)
    assert status == 2 and lines == [
        ("error: train.optim.lr = 1e-08: below half the spacing at 1.0 of AdamW's float32 "
         "weights (5.96046e-08): every update rounds away and the weights would not train")]
    assert not (tmp_path / "run").exists()


def test_rows_that_do_not_split_over_the_context_axis_are_named(tmp_path, capsys):
    cfg = load_config(MICRO)
    cfg.workdir = str(tmp_path / "run")
    cfg.mesh.context, cfg.sft.row_len, cfg.train.row_len = 4, 100, 96
    status, lines = _start(cfg, capsys)
    assert status == 2 and lines == [
        ("error: sft.row_len = 100: must be a multiple of 8 (2 x mesh.context = 4: each "
         "row's tokens split into 2 chunks per device)")]


def test_a_key_no_schema_declares_is_reported(tmp_path, capsys):
    cfg = load_config(MICRO)
    cfg.unlock()
    cfg.train.optim.lrr = 1e-3  # a config file's typo
    assert config.check(cfg) == [
        "train.optim.lrr: not a config key (train/run/schema.py declares every key)"]


def test_every_bad_key_at_once_from_the_command_line(tmp_path):
    """The reported case: ``--config.rollout.temperature=-1`` was accepted, the SFT stage
    ran and a traceback came at the first evaluation."""
    work = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "train.grpo", "--config=configs/grpo_tiny.py",
         f"--config.workdir={work}", "--config.rollout.temperature=-1",
         "--config.rollout.top_p=1.5", "--config.train.optim.lr_multipliers=(('norm', -1.0),)"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error: ")]
    assert [e.split(" = ")[0] for e in errors] == [
        "error: rollout.temperature", "error: rollout.top_p", "error: train.optim.lr_multipliers"]
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert not work.exists()


def test_a_resumed_run_refuses_a_change_of_results_and_lists_extensions(tmp_path, capsys):
    work = tmp_path / "run"
    cfg = load_config(MICRO)
    cfg.workdir = str(work)
    resume.save(cfg, work)
    assert resume.check(cfg, work) == []
    more = load_config(MICRO)
    more.workdir = str(work)
    more.train.steps += 3
    more.checkpoint.every = 7
    assert resume.check(more, work) == [
        f"train.steps {cfg.train.steps} -> {cfg.train.steps + 3} (extends the run)",
        f"checkpoint.every {cfg.checkpoint.every} -> 7"]
    changed = load_config(MICRO)
    changed.workdir = str(work)
    changed.rollout.temperature = 0.5
    changed.train.steps -= 1
    before = sorted(p.name for p in work.iterdir())
    status, lines = _start(changed, capsys)
    assert status == 2
    assert [ln.split(",")[0] for ln in lines] == ["error: rollout.temperature = 0.5",
                                                 f"error: train.steps = {cfg.train.steps - 1}"]
    assert all(f"(in {work}: resume with the saved value" in ln for ln in lines)
    assert sorted(p.name for p in work.iterdir()) == before


def test_a_key_newer_than_the_saved_config_counts_only_off_its_default(tmp_path):
    work = tmp_path / "run"
    cfg = load_config(MICRO)
    resume.save(cfg, work)
    saved = json.loads((work / resume.FILE).read_text())
    del saved["loss.tis_cap"]  # as if the run started before the key existed
    (work / resume.FILE).write_text(json.dumps(saved))
    assert resume.check(cfg, work) == []
    cfg.loss.tis_cap = 2.0
    with pytest.raises(ValueError, match=r"loss.tis_cap = 2.0, but the run was started with 0.0"):
        resume.check(cfg, work)


def test_a_closed_output_pipe_ends_quietly():
    """``--config=... --helpfull | head`` ended in a ``BrokenPipeError`` traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "train.grpo", f"--config={MICRO}", "--helpfull"], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the first line
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141, err[-2000:]
    assert "BrokenPipeError" not in err and "Traceback" not in err, err[-2000:]


def test_an_unknown_op_name_is_named_before_any_work():
    cfg = load_config(MICRO)
    cfg.model.overrides = {**cfg.model.overrides.to_dict(), "attention_impl": "nope"}
    problems = config.check(cfg)
    assert len(problems) == 1 and problems[0].startswith("model.overrides = ")
    assert "'nope'" in problems[0], problems


def _module_error(call) -> str:
    with pytest.raises(ValueError) as exc:
        call()
    return str(exc.value)


@pytest.mark.parametrize("key, value, call", [
    ("loss.old_logprobs", "reference", lambda cfg: updates.Schedule.from_config(cfg)),
    ("train.mini_batches", 3, lambda cfg: updates.Schedule.from_config(cfg)),
    ("train.micro_batches", 0, lambda cfg: updates.Schedule.from_config(cfg)),
    ("loss.logprob_support", "top_p", lambda cfg: experience.scored_on_sampler_support(
        cfg, RolloutSettings.from_config(cfg))),
    ("loss.negative_weight", 1.5, lambda cfg: rl_loss.group_advantages(
        np.ones((2, 2)), negative_weight=cfg.loss.negative_weight)),
    ("loss.clip_ratio_c", 0.9, lambda cfg: updates.loss_config(cfg.loss, 8)),
    ("loss.aggregation", "sum", lambda cfg: rl_loss.aggregate(
        jnp.ones((1, 2)), jnp.ones((1, 2)), jnp.zeros((1, 2), int), 1, cfg.loss.aggregation,
        1)),
    ("sft.optim.decay", "exponential", lambda cfg: optim.schedule(cfg.sft.optim, 10)),
    ("rollout.top_p", 0.0, lambda cfg: RolloutSettings.from_config(cfg)),
])
def test_the_module_raises_the_config_checks_line(key, value, call):
    """A value a module rejects is rejected in the config check's words: both come from
    the rule's one statement (``train.config.domains``)."""
    cfg = config.base_config()
    _set(cfg, key, value)
    line = config.check(cfg)
    assert len(line) == 1 and line[0].startswith(f"{key} = {value!r}: must "), line
    message = _module_error(lambda: call(cfg))
    # the module names the key from where it stands (an optim section: optim.decay)
    assert line[0].endswith(message.partition(" = ")[2]) and key.endswith(
        message.partition(" = ")[0]), (line, message)


def test_the_invariant_mode_names_what_it_cannot_run_and_what_it_makes_unnecessary():
    """``model.numerics = "invariant"`` (issue #41): a tensor axis (split-K matmuls) and a
    truncated draw scored on the whole softmax are refused by key, the mismatch
    corrections are named unnecessary (every importance ratio is exactly 1); the batch
    axes, context, truncated draws scored on the sampler's support and MoE layers check
    clean, an expert capacity (it drops tokens by their neighbours) is refused by name."""
    cfg = load_config(MICRO)
    cfg.model.overrides = {**cfg.model.overrides.to_dict(), "numerics": "invariant"}
    assert config.check(cfg) == []
    cfg.rollout.top_p, cfg.mesh.fsdp, cfg.mesh.context = 0.9, 2, 2
    assert config.check(cfg) == []
    cfg.mesh.tensor, cfg.loss.logprob_support, cfg.loss.tis_cap = 2, "full", 2.0
    problems = config.check(cfg)
    assert [p.split(":")[0] for p in problems] == [
        "mesh.tensor = 2", "loss.logprob_support = 'full'", "loss.tis_cap = 2.0"], problems
    assert "tensor=2" in problems[0] and "'sampler'" in problems[1]
    assert "unnecessary" in problems[2] and "bit for bit" in problems[2]
    moe = {**cfg.model.overrides.to_dict(), "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16}
    cfg.mesh.tensor, cfg.loss.logprob_support, cfg.loss.tis_cap = 1, "sampler", 0.0
    cfg.model.overrides = moe  # MoE layers run per tile (models.moe.invariant)
    assert config.check(cfg) == []
    cfg.model.overrides = {**moe, "expert_capacity_factor": 1.25}  # drops by the batch
    assert any(p.startswith("model.overrides") and "expert_capacity_factor=1.25" in p
               for p in config.check(cfg))
