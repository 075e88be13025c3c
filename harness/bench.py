"""What the benchmarks share: timing (one call; interleaved rounds and their medians) and
the markdown table they print, under the machine line (``harness.machine.describe``).

Timing: a call is timed to its results being ready (``jax.block_until_ready``), in wall
seconds and in CPU seconds of this process (user + system: the work of every thread, which
on a loaded machine moves less than the wall clock). Rows timed against each other run in
interleaved rounds (one call of each per round, after one warm-up call each), so that
load from other processes falls on all of them alike; the medians are reported.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NamedTuple

import jax


class Timing(NamedTuple):
    """Medians of a row's timed calls: CPU seconds of this process, wall seconds, and the
    result of its last call."""

    cpu: float
    wall: float
    last: object


def timed(fn: Callable[[], object]) -> tuple[object, float, float]:
    """``(result, CPU s, wall s)`` of one call of ``fn``, its result ready."""
    c0, w0 = time.process_time(), time.perf_counter()
    out = jax.block_until_ready(fn())
    return out, time.process_time() - c0, time.perf_counter() - w0


def rounds(calls: Mapping[str, Callable[[], object]], repeats: int, *, warmup: int = 1
           ) -> dict[str, Timing]:
    """Each of ``calls`` called ``warmup`` times, then ``repeats`` rounds of one call of
    each in order; the medians of the timed calls by name.

    Raises:
      ValueError: ``repeats`` < 1 or ``warmup`` < 0.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    last = {}
    for name, fn in calls.items():
        for _ in range(warmup):
            last[name] = jax.block_until_ready(fn())
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    wall: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            last[name], c, w = timed(fn)
            cpu[name].append(c)
            wall[name].append(w)
    return {name: Timing(statistics.median(cpu[name]), statistics.median(wall[name]),
                         last[name]) for name in calls}


def table(header: Sequence[str], rows: Iterable[Sequence], align: str | None = None) -> str:
    """A markdown table: ``header``, then each row's cells (``str`` of each). ``align``:
    one character per column, ``"l"`` or ``"r"`` (right-aligned numbers: ``---:``);
    default every column plain.

    Raises:
      ValueError: a row or ``align`` of another width than ``header``.
    """
    width = len(header)
    align = align or "-" * width
    if len(align) != width:
        raise ValueError(f"align {align!r} has {len(align)} columns, the header {width}")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        if len(row) != width:
            raise ValueError(f"a row of {len(row)} cells under a header of {width}: {row!r}")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)
