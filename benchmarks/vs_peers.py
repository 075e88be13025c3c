"""One GRPO iteration, phase by phase, on the stacks users pick instead of this trainer.

    pip install -e '.[train,tunix]' && python benchmarks/vs_peers.py
    python benchmarks/vs_peers.py --rounds 1 --iterations 2          # a quick look

The same workload for every row: a Qwen3-architecture decoder (hidden 64, 3 layers, MLP
256, 4 query / 2 KV heads of 16, tied embedding, vocabulary 151,936, float32, random
init); 16 ``chain_sum`` prompts of ~30 Qwen-BPE tokens (this project's data pipeline,
the same ids for every row) x 8 generations of up to 16 tokens at T = 1 (no top-k /
top-p), stopping at ``<|im_end|>`` / ``<|endoftext|>``; a cheap reward; the GRPO loss
with token-mean aggregation, k3 KL to the reference with beta = 0.04, clip 0.2 both
sides, AdamW lr 1e-5 (b2 0.99) after global-norm clipping at 1.0; one update per
iteration.

Rows (each in its own process, ``benchmarks/vs_peers_workers.py``): Tunix 0.1.7's
``GRPOLearner``, the same inside ``jaxhead.integrations.tunix.drop_in()``, and
``train.grpo``'s ``GRPOIteration``. Rounds interleave them: each round starts every row
once (one warm-up iteration, then ``--iterations`` timed ones), so a change in the
machine's load falls on every row alike. Per phase (generation, reference log-probs, the
train step, and the whole iteration): the median over all timed iterations of CPU
seconds (the process's, all threads) and wall seconds; ratios to Tunix's CPU seconds.
EasyDeL's GRPO trainer is not a row: the table says why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from checkout import ROOT  # the checkout's packages on sys.path

from harness.machine import describe

ROWS = {"tunix": "Tunix 0.1.7 GRPOLearner",
        "tunix-dropin": "Tunix inside jaxhead.integrations.tunix.drop_in()",
        "trainer": "this project's trainer (train.grpo's iteration)"}
PHASES = ("total", "generation", "reference", "train")

#: Why EasyDeL is not a row (``pip install easydel==0.3.0`` in its own environment).
EASYDEL = ("EasyDeL 0.3.0 installs in its own environment only beside jax 0.9.2 / flax "
           "0.12.3 (it pins flax 0.12.3; jaxhead needs jax >= 0.10), and its GRPO trainer "
           "was not wired to this workload: no row")

DIFFERENCES = """\
What differs between the rows (everything else is the workload above):
- generation: Tunix's vanilla sampler left-pads every prompt to max_prompt_length = 32
  and computes float32 logits for all 32 prompt positions at prefill ([128, 32, 151936])
  and [128, 151936] logits per decode step (its model returns them), drawn by
  jax.random.categorical, one Gumbel variate per id; the drop-in draws from the same
  logits with jaxhead.sample_from_logits (one variate per block of 128 ids; another
  random stream, the same distribution); the trainer left-pads prompts to a multiple of
  64 and samples with jaxhead.sample from the final hidden states, prefill included (no
  logits of the prompt positions, no [B, V] logits per decode step).
- reference log-probs: Tunix runs the reference on [128, 32 + 16] unpacked rows with the
  full logits; the drop-in on the same rows through jaxhead (completion positions only);
  the trainer on packed rows (2 sequences per 128-token row) through jaxhead (kept tokens
  only, compacted into a static bucket).
- train step: Tunix's loss differentiates the full [128, 16, 151936] logits; the drop-in
  and the trainer recompute the head in the backward pass, never holding them; the
  trainer's batch is the packed rows above.
- random init: each stack draws its own weights (same shapes); reward and advantages are
  computed by each stack with the same reward function.
"""


def workload(iterations: int, rounds: int) -> dict:
    """The prompts (ids, text) and shared settings every row reads."""
    from configs import grpo_tiny
    from train.data.tasks import Tasks
    from train.data.tokenizer import load_tokenizer
    from train.run.setup import task_specs

    cfg = grpo_tiny.get_config()
    tok = load_tokenizer(cfg.tokenizer)
    tasks = Tasks(task_specs(cfg.data), tok, cfg.data.max_prompt_len,
                        prefill_answer_tag=cfg.data.prefill_answer_tag,
                        stop_at_close_tag=False, system_prompt=cfg.data.system_prompt)
    n = 16 * (iterations + 1)
    problems = [tasks.problem_at(cfg.seed, i) for i in range(n)]
    o = cfg.model.overrides
    return {
        "prompt_ids": [list(p.prompt) for p in problems],
        "texts": [tok.decode(p.prompt) for p in problems],
        "num_valid": tok.num_valid, "stop_ids": list(tok.stop_ids), "pad_id": tok.eos_id,
        "prompts": 16, "group": 8, "new_tokens": 16, "temperature": 1.0, "beta": 0.04,
        "clip": 0.2, "tunix_prompt_len": 32,  # Tunix pads prompts to it
        "optim": {"lr": 1e-5, "b1": 0.9, "b2": 0.99, "eps": 1e-8, "clip_norm": 1.0},
        "model": {"layers": o["num_hidden_layers"], "vocab": o["vocab_size"],
                  "hidden": o["hidden_size"], "intermediate": o["intermediate_size"],
                  "heads": o["num_attention_heads"], "kv_heads": o["num_key_value_heads"],
                  "head_dim": o["head_dim"], "rope_theta": 1_000_000},
    }


def run_row(row: str, path: str, iterations: int) -> list[dict]:
    """One row's process; its timed iterations."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_peers_workers.py"),
                          row, path, str(iterations)], env=env, capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"row {row} failed:\n{out.stderr[-4000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def table(results: dict[str, list[dict]]) -> str:
    med = {row: {p: [statistics.median(it[p][k] for it in its) for k in (0, 1)]
                 for p in PHASES} for row, its in results.items()}
    base = med.get("tunix", next(iter(med.values())))
    lines = ["| implementation | " + " | ".join(f"{p} CPU s (wall s)" for p in PHASES)
             + " | " + " | ".join(f"{p} CPU ratio" for p in PHASES) + " |",
             "|---" * (1 + 2 * len(PHASES)) + "|"]
    for row, m in med.items():
        cells = [f"{m[p][0]:.2f} ({m[p][1]:.2f})" for p in PHASES]
        ratios = [f"{m[p][0] / base[p][0]:.3f}x" for p in PHASES]
        lines.append(f"| {ROWS[row]} | " + " | ".join(cells + ratios) + " |")
    lines.append(f"| EasyDeL GRPO trainer | {EASYDEL} |" + " |" * (2 * len(PHASES) - 1))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iterations", type=int, default=5, help="timed iterations per round")
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--json", help="also write every timed iteration here")
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(workload(args.iterations, args.rounds), f)
    load = [os.getloadavg()]
    results: dict[str, list[dict]] = {row: [] for row in rows}
    for r in range(args.rounds):
        for row in rows:
            results[row] += run_row(row, f.name, args.iterations)
            load.append(os.getloadavg())
            print(f"round {r + 1}/{args.rounds}: {row} done", file=sys.stderr, flush=True)
    n = args.rounds * args.iterations
    print(f"GRPO iteration, medians of {n} iterations per row ({args.rounds} interleaved "
          f"rounds of {args.iterations} after a warm-up each), on {describe()}; 1-minute "
          f"load average {min(x[0] for x in load):.1f}-{max(x[0] for x in load):.1f} "
          "(CPU seconds are the measure on a shared machine)\n")
    print(table(results))
    print()
    print(DIFFERENCES)
    if args.json:
        Path(args.json).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
