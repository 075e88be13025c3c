"""The pod presets' GRPO step (bfloat16 compute, float32 parameters, scanned layers,
remat) on an 8-device mesh against the float32 one-device step, for each architecture the
presets train (``tests/train/fidelity_cases.py``): the loss and every parameter's gradient,
on a packed, padded, templated batch. ``benchmarks/fidelity.py`` prints the errors over
seeds that the bounds below come from (docs/numerics.md)."""

from __future__ import annotations

from tests.support.multidevice import run_case

#: case -> (loss, gradient Frobenius, worst gradient row, the template id's embedding row)
#: relative-error bounds: the largest error over 5 seeds times about 1.5.
BOUNDS = {
    "dense_tied": (5e-3, 0.1, 0.4, 0.1),
    "dense_untied": (5e-3, 0.1, 0.4, 0.1),
    "moe": (1e-2, 0.1, 0.6, 0.1),
    "dense_tied_f32": (1e-5, 1e-4, 1e-3, 1e-4),
}


def test_pod_precision_step_matches_float32_reference():
    r = run_case("tests.train.fidelity_cases:all_cases")
    assert set(r) == set(BOUNDS)
    for name, d in r.items():
        loss, fro, row, template = BOUNDS[name]
        assert d["finite"], name
        assert d["loss"] <= loss, (name, d["loss"])
        for key, (f, w) in d["grads"].items():
            assert f <= fro and w <= row, (name, key, f, w)
        assert d["template_row"] <= template, (name, d["template_row"])
        assert d["template_count"] > 300  # the repeated id is most of the template
