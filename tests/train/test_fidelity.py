"""The pod presets' GRPO step (bfloat16 compute, float32 parameters, scanned layers,
remat) on an 8-device mesh against the float32 one-device step, for each architecture the
presets train (``harness/fidelity.py``): the loss and every parameter's gradient,
on a packed, padded, templated batch. ``benchmarks/fidelity.py`` prints the errors over
seeds that the bounds below come from (docs/numerics.md)."""

from __future__ import annotations

from tests.support.multidevice import run_case

#: case -> (loss, gradient Frobenius, worst gradient row, the template id's embedding row)
#: relative-error bounds: the largest error over 4 seeds (benchmarks/fidelity.py, in
#: docs/numerics.md) times about 1.5.
BOUNDS = {
    "dense_tied": (4e-3, 4e-2, 0.12, 3e-2),
    "dense_untied": (6e-3, 0.15, 0.4, 0.15),
    "moe": (4e-3, 0.12, 0.36, 3e-2),
    "dense_tied_f32": (3e-7, 2e-6, 6e-6, 1e-6),
}


def test_pod_precision_step_matches_float32_reference():
    r = run_case("harness.fidelity:all_cases")
    assert set(r) == set(BOUNDS)
    for name, d in r.items():
        loss, fro, row, template = BOUNDS[name]
        assert d["finite"], name
        assert d["loss"] <= loss, (name, d["loss"])
        for key, (f, w) in d["grads"].items():
            assert f <= fro and w <= row, (name, key, f, w)
        assert d["template_row"] <= template, (name, d["template_row"])
        assert d["template_count"] > 300  # the repeated id is most of the template
