"""One decode step's draw at a real vocabulary: CPU and wall seconds per call.

    python benchmarks/sampling.py                      # B = 128, H = 64, V = 151,936
    python benchmarks/sampling.py --rows 32 --hidden 1024

Rows, each jitted and timed after a warm-up (medians of ``--repeats`` calls):
- ``jax.random.categorical`` on the float32 ``[B, V]`` logits (one Gumbel variate per id:
  the draw of Tunix's vanilla sampler and of most JAX decoders);
- the usual nucleus: ``lax.top_k`` over the whole row (a sort), softmax, cumulative sum, a
  mask and ``categorical`` over the sorted row (top_p = 0.9);
- ``jaxhead.sample_from_logits`` on the same logits, untruncated and with top_p = 0.9;
- ``jaxhead.sample`` from the hidden states and the weight (the logits' matmul included,
  never ``[B, V]``), and that matmul alone, for scale.
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import jax.numpy as jnp

import jaxhead
from harness import bench
from harness.machine import describe


def nucleus_by_sort(logits, key, top_p):
    """Top-p by sorting the whole row (what a JAX decoder without jaxhead does)."""
    sorted_logits, ids = jax.lax.top_k(logits, logits.shape[-1])
    p = jax.nn.softmax(sorted_logits, axis=-1)
    outside = jnp.cumsum(p, axis=-1) - p > top_p
    j = jax.random.categorical(key, jnp.where(outside, -jnp.inf, sorted_logits))
    return jnp.take_along_axis(ids, j[:, None], axis=1)[:, 0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151_936)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    k1, k2, key = jax.random.split(jax.random.key(0), 3)
    hidden = jax.random.normal(k1, (args.rows, args.hidden), jnp.float32)
    weight = jax.random.normal(k2, (args.hidden, args.vocab), jnp.float32) * 0.3
    logits = hidden @ weight
    rows = [
        ("jax.random.categorical(logits)", lambda l, k: jax.random.categorical(k, l),
         (logits, key)),
        ("nucleus by sort (top_p 0.9)", lambda l, k: nucleus_by_sort(l, k, 0.9), (logits, key)),
        ("jaxhead.sample_from_logits(logits)",
         lambda l, k: jaxhead.sample_from_logits(l, k).tokens, (logits, key)),
        ("jaxhead.sample_from_logits(logits, top_p=0.9)",
         lambda l, k: jaxhead.sample_from_logits(l, k, top_p=0.9).tokens, (logits, key)),
        ("jaxhead.sample(hidden, weight)", lambda h, w, k: jaxhead.sample(h, w, k).tokens,
         (hidden, weight, key)),
        ("logits matmul alone (hidden @ weight)", lambda h, w: h @ w, (hidden, weight)),
    ]
    print(f"one draw of [{args.rows}, {args.vocab}] (H = {args.hidden}), float32, medians "
          f"of {args.repeats} calls, on {describe()}, {jax.default_backend()}\n")
    jitted = {name: (jax.jit(fn), fn_args) for name, fn, fn_args in rows}
    calls = {name: (lambda f=f, a=a: f(*a)) for name, (f, a) in jitted.items()}
    times = bench.rounds(calls, args.repeats)
    print(bench.table(["draw", "CPU s", "wall s"],
                      [[name, f"{t.cpu:.3f}", f"{t.wall:.3f}"] for name, t in times.items()]),
          flush=True)


if __name__ == "__main__":
    main()
