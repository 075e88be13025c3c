"""Every Pallas Triton kernel of the head compiles to an sm_90 cubin without spilling.

Needs the ``triton`` package (``pip install triton``; brings ``ptxas`` and ``cuobjdump``),
not a GPU; skipped without it. For each case of ``harness/triton_compile.CASES``
(bf16 Qwen vocabulary, as ``[H, V]`` and as a ``[V, H]`` tied table; soft-cap + per-token
temperature with a ragged vocabulary; float32 with per-token temperature) the forward
kernel and the backward's ``du`` kernel are lowered for cuda on CPU and compiled by Triton for sm_90 (H100 / H200): no local memory
(no register spills) and at most 227 KiB of shared memory per block. About 3 minutes on 2
cores on a cold Triton cache (``~/.triton/cache``), seconds on a warm one.

    pytest -q tests/jaxhead/test_triton_compile.py
    python benchmarks/gpu_check.py --resources     # the same numbers as a table
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs the triton package (its ptxas) to build cubins")

from harness import triton_compile as trc

KERNELS = ("jaxhead_head_forward", "jaxhead_head_dlogits")


@pytest.mark.parametrize("case", trc.CASES, ids=[c.name for c in trc.CASES])
def test_kernels_fit_an_sm90_without_spills(case):
    kernels = trc.lowered_kernels(case)
    assert kernels[0].name == KERNELS[0] and {k.name for k in kernels[1:]} == {KERNELS[1]}
    for kernel in kernels:
        used = trc.resources(kernel)
        assert used.local == 0 and used.stack == 0, f"{case.name}: spills: {used}"
        assert 0 < used.shared <= trc.SM90_SHARED_LIMIT, f"{case.name}: {used}"
        assert 0 < used.registers <= 255, f"{case.name}: {used}"
