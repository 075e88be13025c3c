"""Compiled temporaries of Tunix's GRPO loss, forward + backward, with and without jaxhead.

Nothing is allocated: Tunix's GRPO policy loss (``tunix.rl.algo_core.grpo_loss_fn``) and
the adapter's (``jaxhead.integrations.tunix.grpo_loss_fn``) are differentiated with respect
to the parameters of a Tunix Qwen3 model, lowered on abstract shapes
(``jax.ShapeDtypeStruct``) and compiled for the CPU; ``Compiled.memory_analysis()`` gives
XLA's temporaries (``temp_size_in_bytes``: everything but arguments and outputs). The model
has ``--layers`` decoder layers (default 0: input embedding, final norm and LM head, so the
numbers are the loss's head, which is all the adapter changes). The batch is ``--batch``
sequences of ``--prompt`` prompt and ``--completion`` completion tokens, with reference
log-probs (``beta = 0.04``), as a GRPO step has them.

Two rows per dtype. ``grads = head``: the gradient of every parameter but the (untied)
input embedding table, i.e. of the loss, the LM head and the final norm, with ``dL/dhidden``
computed; this is the loss's own cost, the one the adapter changes. ``grads = all``: the
input embedding's gradient (a scatter-add into a ``[V, H]`` table at the decoder's input,
the same work whichever loss runs: in bf16 it adds ~2.9 GiB to either at the default
shape) comes on top.

    python benchmarks/tunix_memory.py                        # H=4096, V=151936, 16 x 1024
    python benchmarks/tunix_memory.py --hidden 512 --vocab 32768 --batch 4 --dtype float32

Prints a markdown table, one row per (dtype, grads).

``--topology`` (needs ``libtpu``; no TPU) compiles Tunix's whole GRPO train step instead:
Tunix's Qwen3-0.6B (``ModelConfig.qwen3_0p6b``, bf16 compute, float32 parameters) with
its own FSDP sharding over ``--fsdp`` chips of the slice, the GRPO loss (Tunix's or the
adapter's), its gradient and an Adam update (float32 moments) with parameters and
optimiser state donated, compiled by the TPU compiler; per-device memory from
``memory_analysis()``. ``benchmarks/memory.py --preset qwen3-0.6b --topology v5e:2x2
--mesh fsdp=4 --batch 4 --seq 2048 --keep 0.5`` compiles this project's step on the same
tokens (4 sequences of 1024 prompt + 1024 completion tokens).

    python benchmarks/tunix_memory.py --topology v5e:2x2 --fsdp 4 --batch 4 \
        --prompt 1024 --completion 1024
"""

from __future__ import annotations

import argparse
import dataclasses

GIB = 2**30


def measure(*, hidden: int, vocab: int, batch: int, prompt: int, completion: int,
            dtype: str = "float32", layers: int = 0, tied: bool = False,
            embedding_grad: bool = False) -> dict:
    """Temporaries (bytes) of Tunix's GRPO loss fwd+bwd with Tunix's head and jaxhead's.

    ``embedding_grad``: also differentiate the input embedding table (always, when tied:
    it is then the head). ``dtype``: the model's ``dtype`` and ``param_dtype``.

    Returns:
      ``{"tunix": bytes, "jaxhead": bytes}``: ``temp_size_in_bytes`` of the two compiled
      gradient functions.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import algo_core, common
    from tunix.rl.grpo import grpo_learner

    from jaxhead.integrations import tunix as jaxhead_tunix

    cfg = qwen3.ModelConfig(
        num_layers=layers, vocab_size=vocab, embed_dim=hidden, hidden_dim=3 * hidden,
        num_heads=max(hidden // 128, 1), head_dim=128, num_kv_heads=max(hidden // 512, 1),
        rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=tied,
        dtype=jnp.dtype(dtype), param_dtype=jnp.dtype(dtype),
    )
    graphdef, state = nnx.split(nnx.eval_shape(lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))))
    sds = jax.ShapeDtypeStruct
    example = common.TrainExample(
        prompt_ids=sds((batch, prompt), jnp.int32),
        prompt_mask=sds((batch, prompt), jnp.bool_),
        completion_ids=sds((batch, completion), jnp.int32),
        completion_mask=sds((batch, completion), jnp.bool_),
        advantages=sds((batch,), jnp.float32),
        ref_per_token_logps=sds((batch, completion), jnp.float32),
        old_per_token_logps=None,
    )
    algo = grpo_learner.GRPOConfig(num_generations=2, beta=0.04)
    algo.temperature = 0.9

    frozen = not (embedding_grad or tied)

    def temp_bytes(loss_fn):
        def grads(state, example):
            table = {"embedder": state["embedder"]} if frozen else {}
            params = nnx.State({k: v for k, v in state.items()
                                if not (frozen and k == "embedder")})

            def loss(params):
                model = nnx.merge(graphdef, nnx.State({**params, **table}))
                return loss_fn(model, example, algo, 0, 1)

            return jax.grad(loss, has_aux=True)(params)

        compiled = jax.jit(grads).lower(state, example).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    return {"tunix": temp_bytes(algo_core.grpo_loss_fn),
            "jaxhead": temp_bytes(jaxhead_tunix.grpo_loss_fn)}


def measure_step(*, topology: str, fsdp: int, batch: int, prompt: int, completion: int
                 ) -> dict:
    """Per-device GiB of Tunix's GRPO train step at Qwen3-0.6B's shapes compiled for
    ``topology`` (FSDP over its first ``fsdp`` chips), with Tunix's loss and the
    adapter's: ``{"tunix": {...}, "jaxhead": {...}}``, each ``temp`` / ``peak`` / ``args``
    (``memory_analysis``; peak = arguments + temporaries + outputs - aliased) and
    ``compile`` seconds."""
    import os
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import algo_core, common
    from tunix.rl.grpo import grpo_learner

    from jaxhead.integrations import tunix as jaxhead_tunix

    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's machine-wide lock
    devices = topologies.get_topology_desc(topology_name=topology, platform="tpu").devices
    mesh = jax.sharding.Mesh(np.array(devices[:fsdp]).reshape(fsdp, 1), ("fsdp", "tp"))
    cfg = dataclasses.replace(qwen3.ModelConfig.qwen3_0p6b(), dtype=jnp.bfloat16,
                              param_dtype=jnp.float32)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: qwen3.Qwen3(cfg, rngs=nnx.Rngs(0))))
    p_shard = jax.tree.map(lambda spec: NamedSharding(mesh, spec),
                           nnx.get_partition_spec(state))
    tx = optax.adam(1e-6, b1=0.9, b2=0.999, eps=1e-8, mu_dtype=jnp.float32)
    opt = jax.eval_shape(tx.init, state)
    o_shard = optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, opt, p_shard, transform_non_params=lambda _: NamedSharding(mesh, P()))
    sds = jax.ShapeDtypeStruct
    example = common.TrainExample(
        prompt_ids=sds((batch, prompt), jnp.int32), prompt_mask=sds((batch, prompt), jnp.bool_),
        completion_ids=sds((batch, completion), jnp.int32),
        completion_mask=sds((batch, completion), jnp.bool_),
        advantages=sds((batch,), jnp.float32),
        ref_per_token_logps=sds((batch, completion), jnp.float32), old_per_token_logps=None)
    algo = grpo_learner.GRPOConfig(num_generations=2, beta=0.04)
    algo.temperature = 1.0
    rows = NamedSharding(mesh, P("fsdp"))
    e_shard = jax.tree.map(lambda _: rows, example)

    def compiled(loss_fn):
        def step(state, opt_state, example):
            def loss(state):
                return loss_fn(nnx.merge(graphdef, state), example, algo, 0, 1)[0]

            value, grads = jax.value_and_grad(loss)(state)
            updates, opt_state = tx.update(grads, opt_state, state)
            return optax.apply_updates(state, updates), opt_state, value

        run = jax.jit(step, in_shardings=(p_shard, o_shard, e_shard),
                      out_shardings=(p_shard, o_shard, None), donate_argnums=(0, 1))
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            mem = run.lower(state, opt, example).compile().memory_analysis()
        peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                + mem.output_size_in_bytes - mem.alias_size_in_bytes)
        return {"temp": mem.temp_size_in_bytes / GIB, "peak": peak / GIB,
                "args": mem.argument_size_in_bytes / GIB,
                "compile": time.perf_counter() - start}

    return {"tunix": compiled(algo_core.grpo_loss_fn),
            "jaxhead": compiled(jaxhead_tunix.grpo_loss_fn)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--completion", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=0)
    parser.add_argument("--tied", action="store_true")
    parser.add_argument("--dtype", default="float32,bfloat16",
                        help="comma-separated model dtypes")
    parser.add_argument("--grads", default="head,all", help="comma-separated: head, all")
    parser.add_argument("--topology", default=None,
                        help="e.g. v5e:2x2: Tunix's whole Qwen3-0.6B train step, TPU compiler")
    parser.add_argument("--fsdp", type=int, default=4, help="with --topology")
    args = parser.parse_args(argv)
    if args.topology:
        m = measure_step(topology=args.topology, fsdp=args.fsdp, batch=args.batch,
                         prompt=args.prompt, completion=args.completion)
        print(f"Tunix GRPO train step, Qwen3-0.6B (bf16 compute, f32 params, Adam), "
              f"{args.batch} x ({args.prompt} + {args.completion}) tokens, fsdp={args.fsdp} "
              f"on {args.topology}, TPU compiler, per device")
        print("| loss | arguments GiB | temporaries GiB | peak GiB | compile s |")
        print("|---|---|---|---|---|")
        for name, r in (("Tunix's grpo_loss_fn", m["tunix"]),
                        ("jaxhead_tunix.grpo_loss_fn", m["jaxhead"])):
            print(f"| {name} | {r['args']:.2f} | {r['temp']:.2f} | {r['peak']:.2f} "
                  f"| {r['compile']:.0f} |", flush=True)
        return
    print("| H | V | completion tokens | dtype | grads | Tunix GiB | jaxhead GiB | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for dtype in args.dtype.split(","):
        for grads in args.grads.split(","):
            m = measure(hidden=args.hidden, vocab=args.vocab, batch=args.batch,
                        prompt=args.prompt, completion=args.completion, dtype=dtype,
                        layers=args.layers, tied=args.tied, embedding_grad=grads == "all")
            print(f"| {args.hidden} | {args.vocab} | {args.batch * args.completion} "
                  f"| {dtype} | {grads} | {m['tunix'] / GIB:.2f} | {m['jaxhead'] / GIB:.2f} "
                  f"| 1/{m['tunix'] / m['jaxhead']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
