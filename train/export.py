"""A run's policy as a Hugging Face checkpoint directory that ``transformers`` and vLLM load:

    python -m train.export --run=runs/NAME [--step=N] [--stage=grpo|sft] --out=DIR \
        [--dtype=bfloat16|float32] [--replace]

The directory holds ``config.json`` (the model's architecture: ``Qwen3ForCausalLM``,
``Qwen3MoeForCausalLM``, ``Qwen2ForCausalLM`` or ``LlamaForCausalLM``, ``models.hf``),
the weights as ``model.safetensors`` or shards plus ``model.safetensors.index.json``,
``generation_config.json`` (the base checkpoint's stop tokens and the trainer's, the
rollouts' sampling settings: ``generation_config``) and the tokenizer's files
(``train.data.tokenizer.save_tokenizer``: the run's own tokenizer, with a chat template that
renders the trainer's prompts; a base checkpoint's own template kept beside it). The export
owns the directory: it is written beside it and moved into place whole
(``models.save_params``), and a directory holding anything but a previous export is refused
without ``--replace``.

The command reads the run's saved config (``<run>/config.json``) for the model and the
tokenizer, and restores the parameters of one checkpoint (default: the latest step of the
GRPO stage, else of the SFT stage) whole on this process's first device (run it with
``JAX_PLATFORMS=cpu`` to use host memory). The trainer writes the same directory at the
end of a run when ``export.hf_dir`` is set (``at_end``): there the parameters stay in the
run's sharding and, on several hosts, each process writes its own shards
(``models.save_params``).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
from absl import app, flags, logging

import models
from train.data.tasks import answer_prefix
from train.data.tokenizer import load_tokenizer, save_tokenizer
from train.rl import state
from train.rl.rollout_settings import RolloutSettings
from train.run import resume, setup
from train.run.checkpoint import require_checkpoint

_RUN = flags.DEFINE_string("run", None, "the run directory (its --config.workdir)")
_OUT = flags.DEFINE_string("out", None, "the Hugging Face directory to write")
_STEP = flags.DEFINE_integer("step", None, "the checkpoint step (default: the latest)")
_STAGE = flags.DEFINE_enum("stage", None, [setup.GRPO_DIR, setup.SFT_DIR],
                           "the stage (default: grpo if it has a checkpoint, else sft)")
_DTYPE = flags.DEFINE_enum("dtype", "", ["", "float32", "bfloat16"],
                           "tensor dtype in the files ('': the run's parameter dtype)")
_REPLACE = flags.DEFINE_bool("replace", False, "replace --out even if it holds something "
                             "other than a previous export")


#: The token-id fields of a generation config that ``generation_config`` keeps from the base.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def base_checkpoint(cfg) -> Path | None:
    """The Hugging Face directory a run's model or tokenizer came from: ``model.hf_checkpoint``,
    else the ``tokenizer`` directory; None for a preset with the offline Qwen BPE."""
    spec = cfg.model.hf_checkpoint or cfg.tokenizer
    return None if not spec or spec.startswith("qwen:") else Path(spec)


def base_token_ids(directory) -> tuple[Path | None, dict]:
    """The ``TOKEN_ID_FIELDS`` a checkpoint directory sets, as transformers reads them: from
    its ``generation_config.json``, else its ``config.json`` (``eos_token_id`` always a
    list). Returns ``(the file read or None, {field: value})``."""
    for name in ("generation_config.json", "config.json"):
        file = Path(directory) / name
        if file.is_file():
            found = json.loads(file.read_text())
            ids = {k: found[k] for k in TOKEN_ID_FIELDS if found.get(k) is not None}
            if isinstance(ids.get("eos_token_id"), int):
                ids["eos_token_id"] = [ids["eos_token_id"]]
            return file, ids
    return None, {}


def generation_config(cfg, tokenizer) -> dict:
    """``generation_config.json`` of a run, as transformers and vLLM read it.

    It stops where the base checkpoint's does and where the trainer's rollouts stopped:
    ``eos_token_id`` is the base's list (``base_token_ids`` of ``base_checkpoint``; e.g.
    Llama 3.1 Instruct's ``[128001, 128008, 128009]``, ``<|eom_id|>`` included) followed by
    the tokenizer's ``stop_ids`` it lacks; ``bos_token_id`` and ``pad_token_id`` are the
    base's, else the tokenizer's (``pad``: end of text). It samples as the rollouts did
    (``rollout.temperature``, ``top_p``, ``top_k``, ``min_p`` when > 0): nothing else of the
    base's sampling settings (its own temperature, a repetition penalty) is kept. ``top_k``
    0 is "off" for transformers (any version; an absent or null ``top_k`` is 50 there) and
    for vLLM from 0.9.0 (its PR #17773); vLLM 0.8.5 and older refuse it (its issue #17553).

    Raises:
      ValueError: a token id the base sets is outside the tokenizer's vocabulary (the ids,
        the file and the tokenizer named).
    """
    base = base_checkpoint(cfg)
    file, ids = base_token_ids(base) if base is not None else (None, {})
    eos = list(ids.get("eos_token_id", []))
    eos += [i for i in tokenizer.stop_ids if i not in eos]
    given = [*eos, *(ids[k] for k in ("bos_token_id", "pad_token_id") if k in ids)]
    bad = [i for i in given if not (isinstance(i, int) and 0 <= i < tokenizer.num_valid)]
    if bad:
        raise ValueError(f"{file}: token ids {bad} are not in the vocabulary of the run's "
                         f"tokenizer {tokenizer.name} ({tokenizer.num_valid} ids)")
    bos = ids.get("bos_token_id", tokenizer.bos_id)
    out = {**({} if bos is None else {"bos_token_id": bos}), "eos_token_id": eos,
           "pad_token_id": ids.get("pad_token_id", tokenizer.eos_id)}
    return {**out, **RolloutSettings.from_config(cfg).generation_config()}


def save_serving_files(cfg, out) -> list[str]:
    """What a reader needs beside the weights, in the Hugging Face directory ``out``: the
    tokenizer files with the trainer's chat template (``train.data.tokenizer.save_tokenizer``:
    the run's ``data.system_prompt`` and ``train.data.tasks.answer_prefix``) and
    ``generation_config.json`` (``generation_config``).

    Returns:
      The names of the files written, relative to ``out``.

    Raises:
      FileNotFoundError / ValueError: as ``train.data.tokenizer.load_tokenizer`` and
        ``generation_config``.
    """
    out = Path(out)
    spec = cfg.tokenizer or cfg.model.hf_checkpoint
    text = json.dumps(generation_config(cfg, load_tokenizer(spec)), indent=2)
    names = save_tokenizer(spec, out, system=cfg.data.system_prompt,
                           answer_prefix=answer_prefix(cfg.data.prefill_answer_tag))
    (out / "generation_config.json").write_text(text + "\n")
    return [*names, "generation_config.json"]


def export_params(cfg, mdef: state.ModelDef, params: state.Params, out, *,
                  dtype: str = "", replace: bool = False) -> Path:
    """Write ``params`` (the flat parameters of ``mdef``, in any sharding) with ``cfg``'s
    tokenizer and generation settings as a Hugging Face directory ``out``, which appears
    whole, replacing a previous export there (``models.save_params``; ``replace``: replace
    anything there). Every process calls it when the run spans several: each writes its
    own weight shards, process 0 the rest.

    Returns:
      ``out`` as a ``Path``.

    Raises:
      models.CheckpointError: a model no Hugging Face architecture expresses (e.g. a
        final-logit soft-cap).
      FileNotFoundError: the run's tokenizer directory has no ``tokenizer.json``.
      FileExistsError: ``out`` holds something other than a previous export and
        ``replace`` is not set.
      ValueError: a base token id outside the tokenizer (``generation_config``), raised
        before any file is written.
    """
    out = Path(out)
    # config.json's ids are generation_config.json's (a bad base id raises before any file)
    generation = generation_config(cfg, load_tokenizer(cfg.tokenizer or cfg.model.hf_checkpoint))
    ids = {k: generation.get(k) for k in TOKEN_ID_FIELDS}
    by_path = {p: params[state.param_key(p)] for p in mdef.paths}
    models.save_params(by_path, mdef.cfg, out, dtype=dtype or None, metadata=ids,
                       replace=replace, add_files=lambda staging: save_serving_files(cfg, staging))
    return out


def check_destination(cfg) -> None:
    """The trainer's check before a run starts: ``export.hf_dir``, if set, may be written
    at its end (``models.check_export_destination``), so that a run does not train for
    hours to fail there.

    Raises:
      FileExistsError: see ``models.check_export_destination``.
    """
    if cfg.export.hf_dir:
        models.check_export_destination(cfg.export.hf_dir, replace=cfg.export.replace)


def at_end(cfg, s: setup.Setup, params: state.Params) -> None:
    """The trainer's hook when a run ends: ``export_params`` to ``export.hf_dir`` if set."""
    if cfg.export.hf_dir:
        out = export_params(cfg, s.mdef, params, cfg.export.hf_dir, dtype=cfg.export.dtype,
                            replace=cfg.export.replace)
        if s.writer.enabled:
            print(f"exported the final policy to {out}", flush=True)


def latest_stage(run: Path) -> str:
    """``grpo`` if the run has a GRPO checkpoint, else ``sft``.

    Raises:
      FileNotFoundError: neither stage has a checkpoint directory.
    """
    for name in (setup.GRPO_DIR, setup.SFT_DIR):
        if (run / name).is_dir() and any(p.name.isdigit() for p in (run / name).iterdir()):
            return name
    raise FileNotFoundError(f"{run} has no checkpoint (no {setup.GRPO_DIR}/ or "
                            f"{setup.SFT_DIR}/ step directory)")


def export_run(run, out, *, step: int | None = None, stage: str | None = None,
               dtype: str = "", replace: bool = False) -> Path:
    """``python -m train.export``: the parameters of checkpoint ``step`` (default: the
    latest) of ``stage`` (default: ``latest_stage``) of the run directory ``run``, restored
    whole on this process's first device, written by ``export_params``.

    Raises:
      FileNotFoundError: ``run`` is no run directory (no ``config.json``) or has no
        checkpoint of that stage; a ``step`` it does not hold (its steps listed).
      models.CheckpointError, FileExistsError: see ``export_params``.
      ValueError: ``out`` is ``run`` or holds it.
    """
    run = Path(run)
    if run.resolve().is_relative_to(Path(out).resolve()):
        raise ValueError(f"--out={out} is or holds the run directory {run}, which the "
                         "export would replace; choose a directory beside it")
    cfg = resume.saved_config(run)
    stage = stage or latest_stage(run)
    ckpt = require_checkpoint(run / stage)
    try:
        steps = ckpt.all_steps()
        if step is not None and step not in steps:
            raise FileNotFoundError(f"{run / stage} has no step {step}; its steps: {steps}")
        mdef = state.ModelDef.of(setup.run_model_config(cfg))
        device = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("one",))
        whole = jax.sharding.NamedSharding(device, jax.sharding.PartitionSpec())
        abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=whole)
                    for k, v in mdef.abstract_params().items()}
        params = ckpt.restore({"params": abstract}, step)[0]["params"]
    finally:
        ckpt.close()
    return export_params(cfg, mdef, params, out, dtype=dtype, replace=replace)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}")
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines
    try:
        out = export_run(_RUN.value, _OUT.value, step=_STEP.value, stage=_STAGE.value,
                         dtype=_DTYPE.value, replace=_REPLACE.value)
    except (FileNotFoundError, FileExistsError, ValueError) as err:  # CheckpointError: a ValueError
        raise SystemExit(f"error: {err}") from None
    print(f"wrote {out}")


if __name__ == "__main__":
    flags.mark_flags_as_required(["run", "out"])
    app.run(main)
