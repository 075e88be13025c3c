"""Supervised warm start: ``python -m train.sft --config=configs/sft_tiny.py``.

Each training problem becomes ``prompt + "<answer>{answer}</answer><|im_end|>"`` (the
opening tag in the prompt when ``data.prefill_answer_tag``), packed
into rows; the loss is the mean negative log-likelihood of the completion tokens
(CE weights), computed by jaxhead on those tokens only. Checkpoints (params, optimiser
state, step, data position) go to ``<workdir>/sft`` and a rerun resumes from the latest.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from absl import app

from train import export
from train.config import cli
from train.config import domains as d
from train.rl import nonfinite, packing, steps
from train.rl.placement import place_batch
from train.rl.state import Params
from train.run import setup
from train.run.loop import Loop, Stage


def stage(cfg, final_params_only: bool = False) -> Stage:
    """The SFT stage of ``cfg`` (``cfg.sft``) as the loop sees it."""
    c = cfg.sft
    return Stage(setup.SFT_DIR, c.steps, c.batch_size, c.log_every, c.optim, kind="sft",
                 postfix=("nll",), final_params_only=final_params_only)


def sft_metrics(m: dict, packed: packing.PackedBatch, seconds: float) -> dict:
    """The metrics line of one SFT step (besides the loop's ``lr``, ``skipped_prompts``,
    ``peak_memory_bytes``): the step's ``loss``, ``nll``, ``grad_norm``, its wall time,
    tokens/s and the fraction of positions the head computes."""
    return {**{k: float(v) for k, v in m.items()}, "step_seconds": seconds,
            "tokens_per_s": float(np.count_nonzero(packed.segment_ids)) / seconds,
            "lm_head_token_fraction": packed.num_kept / packed.loss_mask.size}


def run_sft(cfg, s: setup.Setup, *, final_params_only: bool = False) -> Params:
    """Run the SFT stage of ``cfg`` in ``<workdir>/sft``: resume from its latest checkpoint,
    or only load the final params if it already finished. ``final_params_only``: the
    last checkpoint keeps the parameters only (``train.grpo``'s warm start: nothing
    else of a finished SFT stage is ever read).

    Returns:
      The final parameters.
    """
    loop = Loop(cfg, s, stage(cfg, final_params_only))
    placement = s.placement
    step_fn = steps.sft_step(s.mdef, loop.tx, placement, skip=cfg.train.skip_unkept,
                             frozen=loop.frozen)
    row_multiple = placement.row_multiple(cfg.sft.row_multiple)  # rows split over shards
    guard = nonfinite.Guard(cfg.sft.max_nonfinite_updates, "sft", s.writer.enabled)

    def iteration(params, opt_state, problems, key, step):
        del key
        t0 = time.perf_counter()
        packed = packing.pack([p.prompt for p in problems],
                              [s.tasks.target_ids(p.answer) for p in problems],
                              cfg.sft.row_len, row_multiple=row_multiple)
        params, opt_state, m = step_fn(params, opt_state,
                                       place_batch(packed.arrays(), placement.mesh),
                                       bucket=placement.bucket(packed, cfg.sft.bucket_multiple))
        flags = jax.device_get(nonfinite.pop_flags(m))  # waits for the step
        skipped = guard.observe(step, [("", flags)])

        def metrics():
            host = jax.device_get(m)
            return {**sft_metrics(host, packed, time.perf_counter() - t0),
                    "nonfinite_updates": skipped}

        return params, opt_state, metrics

    return loop.run(lambda: setup.initial_params(cfg, s), iteration)


def train(cfg, config_file: str | None = None) -> None:
    """``python -m train.sft``: the SFT stage alone (``sft.steps > 0``); its final
    checkpoint keeps the optimiser state (a later run may train it further)."""
    try:
        d.COUNT.require("sft.steps", cfg.sft.steps)
    except ValueError as err:
        raise app.UsageError(f"{err} (train.sft runs the SFT stage alone)") from err
    s = setup.start(cfg, checks=(export.check_destination,))
    if s.writer.enabled:
        print(setup.banner(cfg, s, "train.sft", config_file), flush=True)
    export.at_end(cfg, s, run_sft(cfg, s))  # export.hf_dir
    s.writer.close()


def main(argv):
    del argv
    train(cli.config(), cli.config_file())


if __name__ == "__main__":
    cli.run(main)
