"""The GRPO curve of a run as a PNG: the training batches' sampled reward per step, the
held-out evaluations before and after GRPO with their standard errors, and the held-out
greedy accuracy during GRPO (``eval.curve_every``), read from the run directory
(``metrics.jsonl``; ``eval_before.json`` / ``eval_after.json`` for the paired SE of the
change and the greedy accuracy of the curve's problems before and after). Needs matplotlib (``pip install -e '.[plots]'``); the trainer does not:
``train.grpo`` calls ``write_or_hint`` at the end of a run, which says how to get it when it
is missing. ``python benchmarks/plots.py grpo-curve RUN_DIR...`` draws several runs on one
plot."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import numpy as np

from train.config.domains import FREE, keys
from train.run.evaluate import EvalResult, paired_change
from train.run.schema import schema

FILE = "grpo_curve.png"
WINDOW = 10  # steps in the moving mean of the batch reward


def read_run(workdir) -> dict:
    """A run directory's GRPO curve: ``steps``, batch ``reward`` per step, the held-out
    ``before`` / ``after`` records (or None), ``change``: the held-out sampled reward's
    change and its paired SE (None without both evaluation files), and ``greedy``:
    ``(step, accuracy, SE, problems)`` of the held-out greedy-accuracy curve, with the
    before / after evaluations on the same problems at its ends (empty without one)."""
    workdir = Path(workdir)
    records = [json.loads(ln) for ln in (workdir / "metrics.jsonl").read_text().splitlines()
               if ln.strip()]
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    evals = {r["kind"]: r for r in records if r["kind"] in ("eval_before", "eval_after")}
    greedy = sorted((r["step"], r["greedy_accuracy"], r["greedy_accuracy_se"], r["problems"])
                    for r in records if r["kind"] == "eval_greedy")
    change = None
    files = [workdir / f"eval_{n}.json" for n in ("before", "after")]
    held = {f.stem: EvalResult.from_json(json.loads(f.read_text()))
            for f in files if f.exists()}
    if len(held) == 2:
        before, after = held["eval_before"], held["eval_after"]
        change = paired_change(before.sampled.mean(axis=1), after.sampled.mean(axis=1))
    if greedy:  # the evaluations before and after, on the curve's problems
        n, ends = int(greedy[0][3]), []
        for name, rec in (("eval_before", evals.get("eval_before")),
                          ("eval_after", evals.get("eval_after"))):
            if name in held and rec and rec["step"] not in {g[0] for g in greedy}:
                ends.append((rec["step"], *EvalResult._mean_se(held[name].greedy_correct[:n]),
                             n))
        greedy = sorted(greedy + ends)
    config = workdir / "config.json"
    return {"steps": np.array([r["step"] for r in train]),
            "reward": np.array([r["reward_mean"] for r in train]),
            "before": evals.get("eval_before"), "after": evals.get("eval_after"),
            "change": change, "greedy": greedy,
            "config": json.loads(config.read_text()) if config.exists() else {}}


def labels(runs: dict[str, dict]) -> list[str]:
    """A legend label per run (name -> ``read_run``): the config values that tell the runs
    apart (what they compute: not the run directory, the warm start's path, or how the run
    was carried out), else the run's name."""
    configs = [run["config"] for run in runs.values()]
    if len(runs) < 2 or not all(configs):
        return list(runs)
    specs = keys(schema())
    differ = [k for k in configs[0] if specs.get(k) and specs[k].resume != FREE
              and k != "init.sft_checkpoint" and len({c.get(k) for c in configs}) > 1]
    if not differ:
        return list(runs)
    return ["; ".join(f"{k} = {c.get(k)}" for k in differ) for c in configs]


def grpo_curve(runs: dict[str, dict], out, machine: str) -> Path:
    """Draw ``runs`` (name -> ``read_run``) into the PNG ``out``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 6), dpi=120)
    for i, (label, run) in enumerate(zip(labels(runs), runs.values(), strict=True)):
        color = f"C{i}"
        steps, reward = run["steps"], run["reward"]
        ax.plot(steps, reward, color=color, alpha=0.3, lw=1)
        if len(reward) >= WINDOW:
            mean = np.convolve(reward, np.ones(WINDOW) / WINDOW, mode="valid")
            ax.plot(steps[WINDOW - 1:], mean, color=color, lw=2,
                    label=f"{label}: training batches (thin), mean of {WINDOW} steps")
        held = [(r["step"], r["sampled_reward"], r["sampled_reward_se"])
                for r in (run["before"], run["after"]) if r]
        if held:
            x, y, se = zip(*held, strict=True)
            x = np.array(x) + 1.5 * (i - (len(runs) - 1) / 2)  # side by side
            text = f"{label}: held-out sampled reward ± SE"
            if run["change"]:
                text += f" (change {run['change'][0]:+.3f} ± {run['change'][1]:.3f} paired SE)"
            ax.errorbar(x, y, yerr=se, fmt="o", color=color, ms=7, capsize=5, mec="black",
                        label=text)
        if run.get("greedy"):
            x, y, se, n = zip(*run["greedy"], strict=True)
            ax.errorbar(x, y, yerr=se, fmt="s--", color=color, ms=6, capsize=4, mec="black",
                        label=f"{label}: held-out greedy accuracy ± SE (first {int(n[0])} "
                              "problems)")
    cfg = {k: ast.literal_eval(v) for k, v in next(iter(runs.values()))["config"].items()}
    what = ""
    if cfg:
        what = (f"\n{', '.join(cfg['data.tasks'])}: {cfg['rollout.prompts_per_step']} prompts × "
                f"{cfg['rollout.group_size']} samples per step at "
                f"T={cfg['rollout.temperature']:g}, seed {cfg['seed']}; held out: "
                f"{cfg['eval.size']:,} problems × {cfg['eval.samples']} samples")
    ax.set_title(f"GRPO: sampled reward per step, held-out accuracy{what}\non {machine}",
                 fontsize=10)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward (fraction of correct answers)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def write_or_hint(workdir, machine: str) -> str:
    """Write ``workdir/grpo_curve.png`` and say where, or, without matplotlib, how to get
    it (the line the trainer prints at the end of a run)."""
    if importlib.util.find_spec("matplotlib") is None:
        return (f"plot: matplotlib is not installed; pip install -e '.[plots]', then "
                f"python benchmarks/plots.py grpo-curve {workdir}")
    path = grpo_curve({Path(workdir).name: read_run(workdir)}, Path(workdir) / FILE, machine)
    return f"plot: {path}"
