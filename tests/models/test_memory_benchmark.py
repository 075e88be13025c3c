"""``benchmarks/memory.py`` runs end to end (tiny MoE, 4 fake CPU devices) and prints a
table row (the ragged expert dispatch, emulated on CPU: the whole model through it) whose
parameter bytes match the sharded parameter count, and its breakdown row (saved
activations, the largest arrays of the compiled step)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support import ROOT
from tests.support.multidevice import CASE_FLAGS
from train.config.cli import load_config


def test_memory_benchmark_tiny():
    proc = subprocess.run(
        [sys.executable, "benchmarks/memory.py", "--preset", "tiny-moe",
         "--mesh", "fsdp=2,expert=2", "--seq", "32", "--dispatch", "ragged"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
        # the script compiles and reads XLA's buffer assignment, which LLVM's optimisation
        # level does not change: CASE_FLAGS halves its compile time
        env={**os.environ, "XLA_FLAGS": CASE_FLAGS},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    config, sizes, breakdown = proc.stdout.strip().split("\n\n")
    # the step is the shipped 30B config's: its dtypes, read from the config file
    shipped = load_config(str(ROOT / "configs" / "grpo_qwen3_30b_a3b.py")).model
    assert config == (f"trainer config configs/grpo_qwen3_30b_a3b.py: {shipped.dtype} compute, "
                      f"{shipped.param_dtype} parameters and optimizer moments, numerics "
                      f"default")
    assert (shipped.dtype, shipped.param_dtype) == ("bfloat16", "float32")
    rows = [line for line in sizes.splitlines() if line.startswith("| tiny-moe")]
    assert len(rows) == 1, proc.stdout
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[1:4] == ["fsdp=2 x expert=2", "4", "32"]
    params, adam, temp, host_temp, peak = map(float, cells[4:9])
    assert cells[9] == "yes" and float(cells[10]) > 0 and host_temp == 0
    assert cells[11:13] == ["CPU (approximation)", "ragged (emulated)"]
    assert abs(adam - 2 * params) <= 1e-2 * adam and 0 < temp and peak >= params + adam
    rows = [line for line in breakdown.splitlines() if line.startswith("| tiny-moe")]
    assert len(rows) == 1, proc.stdout
    _, dispatch, saved, weights, largest_saved, largest = (
        c.strip() for c in rows[0].strip("|").split("|"))
    # one sequence of 32 tokens, width 64, 2 layers: at least the bf16 layer inputs are saved
    assert dispatch == "ragged (emulated)"
    assert 2 * 32 * 64 * 2 <= float(saved) * 2**30 < temp * 2**30
    assert float(weights) > 0  # bf16 copies of the float32 weights
    assert largest_saved.count("MiB") == 3 and largest.count("MiB") == 3


def test_largest_temporaries_reads_only_device_memory_temps():
    """Parameters (even with ``color 0``), other memory spaces (TPU VMEM: ``color 1``) and
    outputs are not temporaries; the rest are listed largest first, a buffer once."""
    from harness.memory import largest_temporaries

    lines = [
        "allocation 0: size 64, parameter 0, color 0, shape |f32[16]| at ShapeIndex {}:",
        " value: <1 p @0> (size=64,offset=0): f32[16]{0}",
        "allocation 1: size 1024, color 1, page 0, preallocated-temp:",
        " value: <2 vmem @0> (size=1024,offset=0): f32[256]{0}",
        "allocation 2: size 256, color 0, page 0, preallocated-temp:",
        " value: <3 hbm @0> (size=256,offset=0): f32[64]{0}",
        "allocation 3: size 512, page 0, preallocated-temp:",
        " value: <4 plain @0> (size=512,offset=0): f32[128]{0}",
        "allocation 4: size 2048, output shape is |f32[512]|, maybe-live-out:",
        " value: <5 out @0> (size=2048,offset=0): f32[512]{0}",
    ]
    assert largest_temporaries("\n".join(lines)) == ["0.000488 MiB f32[128] (plain)",
                                         "0.000244 MiB f32[64] (hbm)"]
    # one buffer under two names (a scan's AllocateBuffer and the dynamic-update-slice that
    # fills it in place) is listed once; the same size elsewhere is another buffer
    shared = [
        "allocation 5: size 4096, preallocated-temp:",
        " value: <6 custom-call.1 @0> (size=1024,offset=0): bf16[2,256]{1,0}",
        " value: <7 dynamic-update-slice_fusion.2 @0> (size=1024,offset=0): bf16[2,256]{1,0}",
        " value: <8 other @0> (size=1024,offset=1024): bf16[2,256]{1,0}",
    ]
    assert largest_temporaries("\n".join(shared), count=3) == [
        "0.000977 MiB bf16[2,256] (custom-call.1 = dynamic-update-slice_fusion.2)",
        "0.000977 MiB bf16[2,256] (other)"]


def test_out_of_memory_reads_the_tpu_compilers_figures():
    """A step that does not fit is a row: the figures of the TPU compiler's
    ``CompileTimeHbmOom`` (its message as libtpu 0.0.52 words it; ``G`` is GiB), and any
    other error is not taken for one."""
    from harness.memory import out_of_memory

    message = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the "
               "total memory required for HLO temporaries (19.90G) exceeds available HBM "
               "(15.75G). HLO module: jit_step.")
    assert out_of_memory(message) == (19.9, 15.75)
    assert out_of_memory(message.replace("19.90G", "900.5M")) == (900.5 / 1024, 15.75)
    assert out_of_memory("INVALID_ARGUMENT: shapes do not match") is None
