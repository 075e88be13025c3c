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
from absl import app, logging
from tqdm import tqdm

from train import cli, distributed, packing, setup, state, steps
from train.checkpoint import Checkpointer
from train.metrics import MetricsWriter, peak_memory_bytes
from train.optim import frozen_prefixes, make_optimizer

SFT_DIR = "sft"


def run_sft(cfg, s: setup.Setup, writer: MetricsWriter,
            placement: distributed.Placement | None = None) -> state.Params:
    """Run the SFT stage of ``cfg`` in ``<workdir>/sft``: resume from its latest checkpoint,
    or only load the final params if it already finished. ``placement``: the mesh
    (``train.distributed``; None: from ``cfg.mesh``).

    Returns:
      The final parameters.
    """
    total = cfg.sft.steps
    ckpt = Checkpointer(s.workdir / SFT_DIR, cfg.checkpoint.every, cfg.checkpoint.keep)
    tx, lr = make_optimizer(cfg.sft.optim, total)
    placement = placement or distributed.Placement.from_config(cfg, s.mdef)
    abstract = placement.abstract_state(tx, s.mdef.abstract_params())
    latest = ckpt.latest_step()
    if latest is not None and latest >= total:
        return ckpt.restore({"params": abstract["params"]})[0]["params"]
    if latest is None:
        params = distributed.initial_params(cfg, s, placement)
        opt_state, position, first = placement.init_opt(tx, params), 0, 1
    else:
        items, meta = ckpt.restore(abstract)
        params, opt_state = items["params"], items["opt_state"]
        position, first = meta["data_position"], meta["step"] + 1
        print(f"sft: resuming from checkpoint step {meta['step']}", flush=True)
    stream = s.tasks.train_stream(cfg.data.train_seed, s.exclude, start=position)
    step_fn = steps.sft_step(s.mdef, tx, cfg.train.skip_unkept,
                             frozen_prefixes(cfg.sft.optim), placement)
    bar = tqdm(total=total, initial=first - 1, desc="sft", disable=not writer.enabled)
    for step in range(first, total + 1):
        t0 = time.perf_counter()
        batch = [next(stream) for _ in range(cfg.sft.batch_size)]
        position = batch[-1][0]
        problems = [p for _, p in batch]
        packed = packing.pack([p.prompt for p in problems],
                              [s.tasks.target_ids(p.answer) for p in problems],
                              cfg.sft.row_len,
                              row_multiple=placement.row_multiple(cfg.sft.row_multiple))
        params, opt_state, m = step_fn(params, opt_state, placement.device_batch(packed),
                                       bucket=placement.bucket(packed, cfg.sft.bucket_multiple))
        if step % cfg.sft.log_every == 0 or step == total:
            m = {k: float(v) for k, v in jax.device_get(m).items()}
            seconds = time.perf_counter() - t0
            writer.write(step, {
                **m, "lr": float(lr(step - 1)), "step_seconds": seconds,
                "tokens_per_s": float(np.count_nonzero(packed.segment_ids)) / seconds,
                "lm_head_token_fraction": packed.num_kept / packed.loss_mask.size,
                "skipped_prompts": s.tasks.skipped, "peak_memory_bytes": peak_memory_bytes(),
            }, kind="sft")
            bar.set_postfix(nll=f"{m['nll']:.3f}")
        ckpt.save(step, {"params": params, "opt_state": opt_state},
                  {"step": step, "data_position": position}, force=step == total)
        bar.update(1)
    bar.close()
    ckpt.close()
    return params


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    cfg = cli.config()
    if cfg.sft.steps <= 0:
        raise app.UsageError("sft.steps must be > 0")
    distributed.initialize(cfg)  # before any other JAX call
    s = setup.build_or_exit(cfg)
    writer = MetricsWriter(s.workdir / "metrics.jsonl", enabled=jax.process_index() == 0,
                           tensorboard=cfg.metrics.tensorboard)
    run_sft(cfg, s, writer)
    writer.close()


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
