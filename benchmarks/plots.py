"""The documentation's plots (``docs/img/*.png``), each drawn by one command from a
benchmark's printed output or from run directories. Needs matplotlib:
``pip install -e '.[plots]'``.

    python benchmarks/plots.py head-memory docs/data/head_memory.txt
        # from: python benchmarks/head_memory.py > docs/data/head_memory.txt
    python benchmarks/plots.py grpo-curve runs/grpo_tiny
        # from: the main job's run of docs/training.md ("What the gain is made of")
    python benchmarks/plots.py memory-breakdown docs/data/memory_v6e.txt
        # from: python benchmarks/memory.py --topology v6e:8x8 --seq 4096 --remat \\
        #           > docs/data/memory_v6e.txt

Each writes ``docs/img/<name>.png`` (``--out`` to change). The tables are read as the
benchmarks print them (markdown rows); the machine in a title is the one the benchmark
names in its output, or for a run, this one (``--machine`` to say another).
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import checkout  # noqa: F401  (the checkout's packages on sys.path)

from train.run import plot as run_plot

ROOT = Path(__file__).resolve().parents[1]
IMG = ROOT / "docs" / "img"
#: per-chip HBM of the TPU generations the memory benchmark compiles for, GiB
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def table(text: str, column: str) -> list[dict[str, str]]:
    """The rows, as dicts by column name, of the first markdown table in ``text`` that has
    a column named ``column``.

    Raises:
      ValueError: no such table.
    """
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|") and column in _cells(line):
            names, rows = _cells(line), []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append(dict(zip(names, _cells(row), strict=False)))
            return rows
    raise ValueError(f"no table with a {column!r} column")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def head_memory(text: str, out: Path) -> Path:
    """Temporaries vs tokens, one line per head, log-log (``benchmarks/head_memory.py``)."""
    plt = _pyplot()
    header = text.splitlines()[0]
    notes = dict(re.findall(r"^(\w+): (.+)$", text, re.MULTILINE))
    series: dict[str, list[tuple[int, float]]] = {}
    missing = []
    for row in table(text, "temporaries GiB"):
        try:
            series.setdefault(row["head"], []).append(
                (int(row["tokens"]), float(row["temporaries GiB"])))
        except ValueError:  # "not installed (...)"
            missing.append(row["head"])
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for i, (name, points) in enumerate(series.items()):
        x, y = zip(*points, strict=True)
        ax.plot(x, y, "o-", color=f"C{i}", lw=2.5 if name == "jaxhead" else 1.5,
                label=notes.get(name, name))
    for name in missing:
        ax.plot([], [], " ", label=f"{name}: not installed where this ran")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({x for points in series.values() for x, _ in points})
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])
    ax.set_xlabel("tokens through the head (N)")
    ax.set_ylabel("temporaries of forward + backward (GiB, log scale)")
    shape = re.search(r"H=(\d+), V=(\d+), (\w+)", header)
    on = re.search(r"on (.+?);", header)
    ax.set_title("LM head log-probs, forward + backward: XLA's compiled temporaries\n"
                 f"H={shape.group(1)}, V={int(shape.group(2)):,}, {shape.group(3)}; XLA:CPU "
                 f"compile on {on.group(1) if on else 'this machine'}", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _save(fig, plt, out)


def memory_breakdown(text: str, out: Path) -> Path:
    """Per-device memory of each train-step row as stacked bars (``benchmarks/memory.py``):
    parameters, Adam moments, saved activations, saved weight copies, other temporaries."""
    plt = _pyplot()
    rows = table(text, "params GiB")
    saved = {(r["preset"], r["dispatch"]): r for r in table(text, "saved activations GiB")}
    labels, parts = [], []
    for r in rows:
        extra = saved.get((r["preset"], r["dispatch"]))
        act = float(extra["saved activations GiB"]) if extra else 0.0
        copies = float(extra["saved weight copies GiB (unsharded)"]) if extra else 0.0
        temp = float(r["temporaries GiB"])
        parts.append([float(r["params GiB"]), float(r["Adam m+v GiB"]), act, copies,
                      temp - act - copies])
        labels.append(f"{r['dispatch']} dispatch\n{r['tokens/device']} tokens/device")
    names = ["parameters (f32 shards)", "Adam m + v (f32)", "saved activations",
             "saved bf16 weight copies", "other temporaries (gradients, workspace)"]
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    bottom = [0.0] * len(parts)
    for j, name in enumerate(names):
        heights = [p[j] for p in parts]
        ax.bar(labels, heights, bottom=bottom, color=f"C{j}", label=name, width=0.5)
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    target = rows[0].get("compiled for", "")
    chip = re.search(r"\((v\w+):", target)
    if chip and chip.group(1) in HBM_GIB:
        ax.axhline(HBM_GIB[chip.group(1)], color="black", ls="--", lw=1,
                   label=f"{chip.group(1)} HBM per chip ({HBM_GIB[chip.group(1)]} GiB)")
    for x, total in enumerate(bottom):
        ax.text(x, total + 0.3, f"{total:.1f} GiB", ha="center", fontsize=9)
    ax.set_ylabel("memory per device (GiB)")
    r = rows[0]
    ax.set_title(f"{r['preset']}: GRPO train step, memory per device\nmesh {r['mesh']} "
                 f"({r['devices']} devices); compiled by {target or 'XLA:CPU'}, nothing run",
                 fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    ax.set_ylim(0, max(max(bottom), HBM_GIB.get(chip.group(1), 0) if chip else 0) * 1.25)
    return _save(fig, plt, out)


def _save(fig, plt, out: Path) -> Path:
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="plot", required=True)
    a = sub.add_parser("head-memory", help="temporaries vs tokens (benchmarks/head_memory.py)")
    a.add_argument("output", type=Path, help="the benchmark's printed output")
    b = sub.add_parser("grpo-curve", help="sampled reward per GRPO step of run directories")
    b.add_argument("runs", type=Path, nargs="+", help="run directories (metrics.jsonl)")
    b.add_argument("--machine", default=None, help="the machine the runs ran on")
    c = sub.add_parser("memory-breakdown", help="per-device memory (benchmarks/memory.py)")
    c.add_argument("output", type=Path, help="the benchmark's printed output")
    for s in (a, b, c):
        s.add_argument("--out", type=Path, default=None, help="the PNG (default docs/img/)")
    args = p.parse_args(argv)
    out = args.out or IMG / f"{args.plot.replace('-', '_')}.png"
    if args.plot == "head-memory":
        path = head_memory(args.output.read_text(), out)
    elif args.plot == "memory-breakdown":
        path = memory_breakdown(args.output.read_text(), out)
    else:
        from train.run.metrics import machine

        runs = {d.name: run_plot.read_run(d) for d in args.runs}
        path = run_plot.grpo_curve(runs, out, args.machine or machine())
    print(path)


if __name__ == "__main__":
    main()
