"""Forward+backward time and memory of the LM head: plain JAX vs jaxhead at several keep
fractions. Prints a markdown table.

    python benchmarks/head.py                  # N=2048, H=1024, V=32768 and V=151936, bf16
    python benchmarks/head.py --vocab 32768    # one row set only

The loss is what an RL step differentiates: ``sum(g * logp) + sum(e * entropy)`` with
random cotangents. "plain" is ``jaxhead.reference_token_logprobs`` (full float32 logits,
``log_softmax``; skipped tokens masked after the fact, as plain code does). jaxhead runs
on the kept tokens only, with the bucket the host picks from the ladder. Time: median of
``--repeats`` runs after one warm-up (compile excluded), the implementations interleaved
round by round so that background load affects all alike. Temp: XLA's compiled memory
analysis (temporaries beyond inputs and outputs) of the same jitted function.
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

import jaxhead
from harness import bench

GiB = 2**30


def make_inputs(n, h, v, dtype, seed=0):
    k = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(k[0], (n, h), jnp.float32).astype(dtype)
    weight = (jax.random.normal(k[1], (h, v), jnp.float32) * (2.0 / h**0.5)).astype(dtype)
    labels = jax.random.randint(k[2], (n,), 0, v)
    g = jax.random.normal(k[3], (n,))
    e = jax.random.normal(k[4], (n,))
    return hidden, weight, labels, g, e


def keep_of(n, fraction, seed=1):
    """A keep mask shaped like RL rows: a prompt block skipped, then completion tokens."""
    rows = max(1, n // 512)
    per_row = n // rows
    kept = round(per_row * fraction)
    row = np.arange(per_row) >= per_row - kept
    return jnp.asarray(np.tile(row, rows)[:n])


def grad_fn(head, keep, **kw):
    def loss(hidden, weight, labels, g, e):
        out = head(hidden, weight, labels, keep, **kw)
        return jnp.sum(g * out.logprobs) + jnp.sum(e * out.entropy)

    return jax.jit(jax.grad(loss, (0, 1)))


def measure(fns, args, repeats):
    """Median seconds and compiled temp bytes of each function. Runs are interleaved
    (one of each per round) so that load from other processes hits all of them alike."""
    temps = [fn.lower(*args).compile().memory_analysis().temp_size_in_bytes for fn in fns]
    times = bench.rounds({i: (lambda fn=fn: fn(*args)) for i, fn in enumerate(fns)}, repeats)
    return [times[i].wall for i in range(len(fns))], temps


def run(n, h, v, dtype, fractions, repeats):
    args = make_inputs(n, h, v, dtype)
    names = [("plain JAX", 1.0)] + [("jaxhead", f) for f in fractions]
    fns = [grad_fn(jaxhead.reference_token_logprobs, None)]
    fns += [grad_fn(jaxhead.token_logprobs, None if f == 1.0 else keep_of(n, f)) for f in fractions]
    times, temps = measure(fns, args, repeats)
    for (name, f), t, m in zip(names, times, temps):
        print(f"| {n} | {h} | {v} | {name} | {f:.2f} | {t * 1e3:9.1f} | {t / times[0]:5.2f}x "
              f"| {m / GiB:7.3f} |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 151936])
    p.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}, {a.dtype}, "
          f"fwd+bwd of sum(g*logp)+sum(e*entropy), median of {a.repeats}")
    print("| N | H | V | impl | keep | time ms | vs plain | temp GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for v in a.vocab:
        run(a.tokens, a.hidden, v, jnp.dtype(a.dtype), a.keep, a.repeats)


if __name__ == "__main__":
    main()
