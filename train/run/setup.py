"""What ``train.sft`` and ``train.grpo`` build from a config before their loops: tokenizer,
tasks, held-out eval set, model definition, placement on the mesh, metrics writer, and the
initial parameters."""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import jax

import models
from train.data.tasks import Problem, Tasks
from train.data.tokenizer import Tokenizer, load_tokenizer
from train.rl import state
from train.rl.placement import Placement
from train.rl.rollout_settings import RolloutSettings
from train.run import distributed, resume
from train.run import schema as config
from train.run.checkpoint import check_resumable, require_checkpoint
from train.run.metrics import MetricsWriter

#: The stages' checkpoint directories under the workdir.
SFT_DIR, GRPO_DIR = "sft", "grpo"


@dataclasses.dataclass
class Setup:
    """Everything a trainer needs besides its own loop.

    Attributes:
      workdir: the run directory (absolute).
      tokenizer, tasks: see ``train.data.tokenizer`` / ``train.data.tasks``; ``tasks`` makes the
        held-out set and GRPO's problems.
      eval_problems: the held-out set (distinct questions, eval seed).
      exclude: their question texts (never trained on).
      mdef: the model definition (its config carries ``mesh.rules``).
      hf_params: parameters of ``model.hf_checkpoint`` in the placement's layout, each
        process having read only its devices' slices of the files (None without one).
      placement: the mesh and the arrays' shardings (``train.rl.placement``).
      writer: metrics (``metrics.jsonl`` and TensorBoard in the workdir; process 0 only).
      rollout: the rollout settings (``cfg.rollout``, read once), for everything that
        samples, scores or exports.
    """

    workdir: Path
    tokenizer: Tokenizer
    tasks: Tasks
    eval_problems: list[Problem]
    exclude: set[str]
    mdef: state.ModelDef
    hf_params: state.Params | None
    placement: Placement
    writer: MetricsWriter
    rollout: RolloutSettings
    sft_tasks: Tasks | None = None

    def stage_tasks(self, stage: str) -> Tasks:
        """The problems of a stage's training stream: ``sft_tasks`` for the SFT stage
        (``sft.task_kwargs``; the same as ``tasks`` when that is empty), ``tasks`` for
        GRPO and the held-out set."""
        return self.sft_tasks if stage == SFT_DIR and self.sft_tasks is not None else self.tasks


def task_specs(data_cfg, stage_kwargs=None) -> dict[str, dict]:
    """``{task: kwargs}`` from ``data.tasks`` (a tuple of names) and ``data.task_kwargs``;
    a task in ``stage_kwargs`` (a stage's own ``task_kwargs``, e.g. ``sft.task_kwargs``)
    takes those kwargs instead."""
    kwargs = {**data_cfg.task_kwargs.to_dict(), **(stage_kwargs or {})}
    return {n: dict(kwargs.get(n, {})) for n in data_cfg.tasks}


def model_config(cfg) -> models.ModelConfig:
    """The ``ModelConfig`` of ``cfg.model`` (preset + overrides) with the sharding rules
    of ``cfg.mesh.rules``."""
    m = cfg.model
    return models.get_config(m.preset, dtype=m.dtype, param_dtype=m.param_dtype,
                             sharding_rules=cfg.mesh.rules, **m.overrides.to_dict())


def run_model_config(cfg) -> models.ModelConfig:
    """The model of a run: ``model.hf_checkpoint``'s config (with ``scan_layers`` from
    ``model.overrides``) or ``model_config(cfg)``, with ``model.remat``.

    Raises:
      FileNotFoundError / models.CheckpointError: see ``train.rl.state.load_hf_config``.
    """
    if cfg.model.hf_checkpoint:
        scan = bool(cfg.model.overrides.get("scan_layers", False))
        model_cfg = state.load_hf_config(
            cfg.model.hf_checkpoint, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
            scan_layers=scan).replace(sharding_rules=cfg.mesh.rules)
    else:
        model_cfg = model_config(cfg)
    if cfg.model.remat and not model_cfg.remat:
        model_cfg = model_cfg.replace(remat=True)
    return model_cfg


def build(cfg) -> Setup:
    """Build the shared pieces of a run from its config (after ``train.run.distributed``:
    the mesh spans every process's devices).

    Raises:
      ValueError: unknown task (valid names listed), bad task kwargs, an eval set the task
        space cannot fill.
      FileNotFoundError: a missing ``model.hf_checkpoint`` / ``init.sft_checkpoint`` dir.
      ValueError: a finished stage in the workdir that kept its final parameters only
        but now has more steps (``train.run.checkpoint.check_resumable``).
    """
    workdir = Path(cfg.workdir).absolute()
    tok = load_tokenizer(cfg.tokenizer or cfg.model.hf_checkpoint)

    def make_tasks(stage_kwargs=None) -> Tasks:
        return Tasks(task_specs(cfg.data, stage_kwargs), tok, cfg.data.max_prompt_len,
                     prefill_answer_tag=cfg.data.prefill_answer_tag,
                     stop_at_close_tag=cfg.data.stop_at_close_tag,
                     system_prompt=cfg.data.system_prompt)

    tasks = make_tasks()
    sft_kwargs = cfg.sft.task_kwargs.to_dict()
    sft_tasks = make_tasks(sft_kwargs) if sft_kwargs else tasks
    for name in sft_kwargs:  # a config the task rejects fails here, before any work
        sft_tasks.dataset(name, cfg.data.train_seed)
    if cfg.init.sft_checkpoint:
        require_checkpoint(cfg.init.sft_checkpoint).close()  # fail early, before any work
    check_resumable(workdir / SFT_DIR, cfg.sft.steps)
    check_resumable(workdir / GRPO_DIR, cfg.train.steps)
    mdef = state.ModelDef.of(run_model_config(cfg))
    if tok.num_valid > mdef.cfg.vocab_size:
        raise ValueError(f"tokenizer has {tok.num_valid} tokens but the model's vocabulary "
                         f"is {mdef.cfg.vocab_size}")
    problems = tasks.eval_set(cfg.eval.size, cfg.data.eval_seed)
    placement = Placement.from_config(cfg, mdef)
    hf_params = None
    if cfg.model.hf_checkpoint:  # each process reads only its devices' slices
        hf_params = state.load_hf(cfg.model.hf_checkpoint, mdef, placement.params)
    writer = MetricsWriter(workdir / "metrics.jsonl", enabled=jax.process_index() == 0,
                           tensorboard=cfg.metrics.tensorboard)
    return Setup(workdir, tok, tasks, problems, {p.question for p in problems}, mdef,
                 hf_params, placement, writer, RolloutSettings.from_config(cfg), sft_tasks)


def _exit(status: int, lines: list[str]) -> None:
    print("\n".join(f"error: {line}" for line in lines), file=sys.stderr)
    sys.exit(status)


def start(cfg, checks=()) -> Setup:
    """The preamble of both entry points, before any work:

    1. ``train.run.schema.check``: every value outside its key's domain (a negative
       temperature, an unknown task, a missing checkpoint directory, ...), one
       ``error: key = value: reason`` line each on stderr, then exit status 2;
    2. ``jax.distributed`` when the run spans several processes (before any other JAX
       call);
    3. a run directory started with another config (``train.run.resume``): a value that
       changes the results is one ``error:`` line each and exit status 2; more steps and
       how the run is carried out are listed and allowed;
    4. ``checks`` (callables of ``cfg`` that raise ``ValueError`` on a bad value of the
       entry point's own keys, ``FileExistsError`` on a directory it would not
       overwrite), then ``build``: what they find wrong (a mesh that does not fit the
       devices, an eval set the task cannot fill, ...) is one ``error: ...`` line and exit
       status 1.

    Nothing is written to the run directory before step 4 succeeds, when its
    ``config.json`` records the config.
    """
    problems = config.check(cfg)
    if problems:
        _exit(2, problems)
    distributed.initialize(cfg)
    workdir = Path(cfg.workdir).absolute()
    try:
        changes = resume.check(cfg, workdir)
    except ValueError as err:
        _exit(2, str(err).splitlines())
    lead = jax.process_index() == 0
    if changes and lead:
        print(f"resuming {workdir} with changes: " + "; ".join(changes), flush=True)
    try:
        for check in checks:
            check(cfg)
        s = build(cfg)
    except (ValueError, FileNotFoundError, FileExistsError) as err:  # CheckpointError too
        _exit(1, [str(err)])
    if lead:
        resume.save(cfg, workdir)
    return s


def _millions(n: int) -> str:
    return f"{n / 1e6:.2f}M"


def banner(cfg, s: Setup, entry: str, config_file: str | None = None) -> str:
    """The few lines a run prints at start: config file and run directory, devices and
    mesh, model size, task, held-out set size and the stages' lengths."""
    mesh = s.placement.mesh
    devices = jax.devices()
    sizes = {k: math.prod(a.shape) for k, a in s.mdef.abstract_params().items()}
    head = sum(v for k, v in sizes.items() if k.startswith(("embed_tokens.", "lm_head.")))
    m = s.mdef.cfg
    source = cfg.model.hf_checkpoint or f"preset {cfg.model.preset}"

    def named(kwargs: dict) -> str:
        return ", ".join(f"{t} {kwargs[t]}" if kwargs.get(t) else t for t in cfg.data.tasks)

    tasks = named(cfg.data.task_kwargs.to_dict())
    if cfg.sft.task_kwargs and (entry == "train.sft" or cfg.sft.steps > 0):
        tasks += f" (SFT: {named(task_specs(cfg.data, cfg.sft.task_kwargs.to_dict()))})"
    stages = []
    if entry == "train.sft" or (cfg.sft.steps > 0 and not cfg.init.sft_checkpoint):
        stages.append(f"SFT {cfg.sft.steps} steps x {cfg.sft.batch_size} sequences")
    elif cfg.init.sft_checkpoint:
        stages.append(f"warm start {cfg.init.sft_checkpoint}")
    if entry == "train.grpo":
        r = s.rollout
        stages.append(f"GRPO {cfg.train.steps} steps x {r.prompts_per_step} prompts x "
                      f"{r.group_size} samples")
    return "\n".join([
        (f"{entry}: config {config_file or '(given)'}, run directory {s.workdir}, "
         f"seed {cfg.seed}"),
        (f"devices: {len(devices)} x {devices[0].device_kind} in {jax.process_count()} "
         "process(es), mesh " + " x ".join(f"{a}={n}" for a, n in mesh.shape.items())),
        (f"model: {source}, {_millions(sum(sizes.values()))} parameters "
         f"({_millions(head)} in the embedding / head), depth {m.num_hidden_layers}, "
         f"width {m.hidden_size}, vocabulary {m.vocab_size:,}, {m.param_dtype} parameters, "
         f"{m.dtype} compute"),
        f"task: {tasks}; {len(s.eval_problems):,} held-out problems; " + ", then ".join(stages),
    ])


def initial_params(cfg, s: Setup) -> state.Params:
    """Params to start from, in the placement's layout: ``init.sft_checkpoint`` (its
    latest step, restored into the shardings), the HF checkpoint (read in that layout by
    ``build``), or a random init with ``cfg.seed`` (created sharded)."""
    if cfg.init.sft_checkpoint:
        ckpt = require_checkpoint(cfg.init.sft_checkpoint)
        try:
            return ckpt.restore({"params": s.placement.abstract_params()})[0]["params"]
        finally:
            ckpt.close()
    if s.hf_params is not None:
        return s.hf_params
    return s.placement.init_params(cfg.seed)
