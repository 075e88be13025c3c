"""Accuracy of every head implementation against float64, beside the plain float32
full-logits head, on the inputs where float32 is under stress (the cases of
``tests/jaxhead/test_precision.py``, which bounds them):

    python benchmarks/accuracy.py            # ~2 min on 2 CPU cores (kernels interpreted)

Columns: max abs error of log-probs and entropy; max relative error (to the largest
float64 component) of the gradients w.r.t. hidden and weight of ``sum(g logp) +
sum(e entropy)``; the same four for plain float32 (``log_softmax`` of float32 logits, then
autodiff) in parentheses.
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax.numpy as jnp
import numpy as np

from harness.oracle import head_inputs
from harness.precision import IMPLS, errors


def cases():
    """``(name, hidden, weight, labels, kwargs)`` of each stress case."""
    one = jnp.tile(jnp.asarray([[512.0, 511.0]], jnp.float32), (1, 2))
    yield "one row, W = [512, 511]", jnp.ones((2, 1)), one, jnp.asarray([0, 1]), {}
    h, w, y = head_inputs(3, 48, 32, 400, exact_dot=True)
    yield "T = 0.01", h, w, y, {"temperature": np.float32(0.01)}
    h, w, y = head_inputs(4, 48, 32, 400)
    for shift in (1e4, -1e4):
        hs = jnp.concatenate([h, jnp.full((48, 1), shift / 64)], axis=1)
        ws = jnp.concatenate([w, jnp.full((1, 400), 64.0)], axis=0)
        yield f"logits + {shift:+.0e} (hidden)", hs, ws, y, {}
    yield "logits + 1e4 h_0 (weight)", h.at[:, 0].set(1.0 + 0.1 * h[:, 0]), w.at[0].add(1e4), y, {}
    h, w, y = head_inputs(6, 48, 32, 400, exact_dot=True)
    z = np.sort(np.asarray(h @ w, np.float64), axis=1)[:, ::-1]
    sizes = np.linspace(5, 300, 48).astype(int)
    tau = ((z[np.arange(48), sizes - 1] + z[np.arange(48), sizes]) / 2).astype(np.float32)
    yield "min_logit (5..300 ids)", h, w, y, {"min_logit": tau}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", default=",".join(IMPLS))
    args = parser.parse_args()
    print("| case | impl | logp | entropy | dh rel | dw rel |")
    print("|---|---|---|---|---|---|")
    for name, h, w, y, kw in cases():
        for impl in args.impls.split(","):
            got, plain, _ = errors(impl, h, w, y, **kw)
            cells = [f"{got[k]:.1e} ({plain[k]:.1e})" for k in ("logp", "entropy", "dh", "dw")]
            print(f"| {name} | {impl} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
