"""Compiled temporaries of the LM head's forward + backward against the number of tokens:
jaxhead beside the plain full-logits head and the JAX libraries a user would pick instead.
Prints a markdown table (one row per head and token count).

    python benchmarks/head_memory.py                    # H=4096, V=151936, bf16, 1k-64k tokens
    python benchmarks/head_memory.py --tokens 4096 16384 --heads jaxhead plain

Every head computes the float32 log-probability of each token's label and is differentiated
w.r.t. the hidden states and the weight (the loss is ``sum(logp)``, the cross-entropy every
peer offers; jaxhead without its entropy, ``with_entropy=False``). Nothing is run: each
function is compiled for abstract shapes (``jax.ShapeDtypeStruct``) and the table gives XLA's
``memory_analysis().temp_size_in_bytes`` (temporaries beyond inputs and outputs) and the
seconds the compile took. The heads:

* ``jaxhead``: ``jaxhead.token_logprobs`` (``impl="auto"``);
* ``plain``: float32 logits and ``log_softmax`` (``jaxhead.reference_token_logprobs``);
* ``optax``: ``optax.losses.softmax_cross_entropy_with_integer_labels`` on float32 logits;
* ``tokamax``: ``tokamax.linear_softmax_cross_entropy_loss`` (``implementation=None``: the
  best it has for the backend; on CPU its ``"xla"`` implementation);
* ``tunix``: Tunix's path, logits from the head's matmul in the inputs' dtype (as its
  models' LM head computes them), then ``tunix.rl.common.selective_log_softmax``.

A peer that is not installed gets a row saying so (``pip install tokamax google-tunix``
beside jax; tested with tokamax 0.0.12, the newest for Python 3.11, and google-tunix 0.1.7).
The output is what ``benchmarks/plots.py head-memory`` draws.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import time

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import jax.numpy as jnp

import jaxhead
from train.run.metrics import machine

GiB = 2**30


def _jaxhead(hidden, weight, labels):
    return jaxhead.token_logprobs(hidden, weight, labels, with_entropy=False).logprobs


def _plain(hidden, weight, labels):
    return jaxhead.reference_token_logprobs(hidden, weight, labels, with_entropy=False).logprobs


def _optax(hidden, weight, labels):
    import optax  # a peer: imported only when measured

    logits = jnp.dot(hidden, weight, preferred_element_type=jnp.float32)
    return -optax.losses.softmax_cross_entropy_with_integer_labels(logits, labels)


def _tokamax(hidden, weight, labels):
    import tokamax  # a peer: imported only when measured

    return -tokamax.linear_softmax_cross_entropy_loss(hidden, labels, weight, reduction="sum")


def _tunix(hidden, weight, labels):
    from tunix.rl import common  # a peer: imported only when measured

    return common.selective_log_softmax(jnp.dot(hidden, weight), labels)


#: name -> (the distribution it comes from, what it is, the function)
HEADS = {
    "jaxhead": ("jaxhead", "jaxhead.token_logprobs", _jaxhead),
    "plain": ("jax", "plain JAX (f32 logits, log_softmax)", _plain),
    "optax": ("optax", "optax softmax_cross_entropy_with_integer_labels", _optax),
    "tokamax": ("tokamax", "tokamax linear_softmax_cross_entropy_loss (best for the backend)",
                _tokamax),
    "tunix": ("google-tunix", "Tunix selective_log_softmax of the head's logits", _tunix),
}


def temp_bytes(head, n, h, v, dtype) -> tuple[int, float]:
    """(temporary bytes, compile seconds) of ``grad(sum(head(...)))`` at ``[n, h] x [h, v]``."""
    args = (jax.ShapeDtypeStruct((n, h), dtype), jax.ShapeDtypeStruct((h, v), dtype),
            jax.ShapeDtypeStruct((n,), jnp.int32))
    grad = jax.jit(jax.grad(lambda x, w, y: jnp.sum(head(x, w, y)), (0, 1)))
    t0 = time.perf_counter()
    compiled = grad.lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes, time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--heads", nargs="+", default=list(HEADS), choices=list(HEADS))
    a = p.parse_args()
    dtype = jnp.dtype(a.dtype)
    print(f"jax {jax.__version__}, XLA:{jax.devices()[0].platform} compile of abstract shapes "
          f"on {machine()}; H={a.hidden}, V={a.vocab}, "
          f"{a.dtype}; grad of sum(logp) w.r.t. hidden and weight")
    print("| head | tokens | temporaries GiB | compile s |")
    print("|---|---|---|---|")
    for name in a.heads:
        head = HEADS[name][2]
        for n in a.tokens:
            try:
                temp, secs = temp_bytes(head, n, a.hidden, a.vocab, dtype)
            except ImportError as err:
                print(f"| {name} | {n} | not installed ({err.name}) | |", flush=True)
                break
            print(f"| {name} | {n} | {temp / GiB:.3f} | {secs:.1f} |", flush=True)
    print()
    for name in a.heads:
        dist, what, _ = HEADS[name]
        try:
            version = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{name}: {what} ({dist} {version})")


if __name__ == "__main__":
    main()
