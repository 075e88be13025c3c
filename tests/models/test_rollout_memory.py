"""``benchmarks/rollout_memory.py`` runs end to end on XLA:CPU (tiny MoE, 4 fake devices,
the 30B config's rollout shapes) and prints its rows: the ``compact`` engine's decode
chunk holds the KV slots of the pages it is given, fewer than the ``reference`` decoder's
``W + T`` per row, and each of its functions peaks below the reference decoder (which
prefills every prompt G times)."""

from __future__ import annotations

import subprocess
import sys

from tests.support import ROOT
from tests.support.multidevice import device_env


def test_rollout_memory_benchmark_on_cpu():
    # device_env's CASE_FLAGS: the table comes from XLA's buffer assignment, which LLVM's
    # optimisation level does not change, in half the compile time
    env = device_env(4)
    proc = subprocess.run(
        [sys.executable, "benchmarks/rollout_memory.py", "--preset", "tiny-moe",
         "--topology", "cpu", "--mesh", "fsdp=2,expert=2", "--layers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=900, check=False, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, table = proc.stdout.strip().split("\n\n")
    rows = {}
    for line in table.splitlines()[2:]:
        name, *cells = (c.strip() for c in line.strip("|").split("|"))
        rows[name] = [float(c.replace(",", "")) for c in cells]
    assert list(rows) == ["reference: whole decode", "compact: prefill",
                          "compact: decode chunk, T/4 written",
                          "compact: decode chunk, T written"]
    # 1024 rows over 4 devices; prompts of 1024 tokens and T = 2048: W + T slots a row
    assert rows["reference: whole decode"][0] == 256 * (1024 + 2048)
    quarter = rows["compact: decode chunk, T/4 written"]
    whole = rows["compact: decode chunk, T written"]
    # 16 prompts' pages per device, then per row its written tokens and one chunk
    assert quarter[0] == 64 * (16 * 16 + 256 * (512 + 64) // 64)
    assert whole[0] == 64 * (16 * 16 + 256 * (2048 + 64) // 64)
    for name, (_, args, temp, peak, _) in rows.items():
        assert args > 0 and temp >= 0 and peak >= args, name
    assert quarter[3] < whole[3] < rows["reference: whole decode"][3]
    assert rows["compact: prefill"][3] < rows["reference: whole decode"][3]
