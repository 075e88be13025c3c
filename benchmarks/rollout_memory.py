"""Per-device memory of a preset's rollout, compiled by the real TPU compiler for a pod slice
on a machine without a TPU (``pip install -e '.[tpu]'``): the ``reference`` engine's
decoder (every row holds ``W + T`` KV slots from the start) against the ``compact``
engine's prefill and decode chunk (a paged KV cache, the G samples sharing their prompt's
pages), at the pool sizes a call reaches.

    python benchmarks/rollout_memory.py                             # 30B preset, v6e:8x8
    python benchmarks/rollout_memory.py --topology v5e:8x8 --dispatch dense
    python benchmarks/rollout_memory.py --layers 2 --topology v6e:2x2 --mesh fsdp=1,expert=4
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/rollout_memory.py \
        --preset tiny-moe --topology cpu --mesh fsdp=2,expert=2     # XLA:CPU (a check)

The rollout is the config's (``configs/<config>.py``) with the model ``--preset`` (the
config loads its weights from a checkpoint): its dtypes, ``prompts_per_step`` x
``group_size`` rows, prompts of ``data.max_prompt_len`` tokens, ``max_new_tokens``, the
engine's page size and decode chunk; the mesh is the preset's on the slice's devices
(``--mesh`` overrides it). Every function is lowered on abstract inputs
(``jax.ShapeDtypeStruct`` with the run's shardings) and compiled;
``memory_analysis()`` gives each device's arguments, temporaries and peak. The
``compact`` rows: the prefill, and the decode chunk with every row decoding at the full
rung and a pool of the prompts' pages (one copy per shard, plus each row's partly filled
last page) and, per row, the pages of ``written`` tokens plus one chunk, where
``written`` is a quarter of ``T`` (the mean of a long-tailed batch whose longest row
reaches ``T``) or all of ``T`` (every row at its budget: the worst case).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from harness.machine import describe
from harness.memory import parse_mesh, topology_devices
from models import get_config
from models.generate import Rows
from models.mesh import BATCH_AXES, make_mesh, present
from train.config.cli import load_config
from train.rl import rollout, state
from train.rl.placement import Placement

GIB = 2 ** 30


def _abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        tree)


def _memory(lowered) -> tuple[float, float, float, float]:
    """``(arguments, temporaries, peak GiB per device, compile s)`` of a lowered call."""
    start = time.perf_counter()
    mem = lowered.compile().memory_analysis()
    seconds = time.perf_counter() - start
    peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
            + mem.output_size_in_bytes - mem.alias_size_in_bytes)
    return (mem.argument_size_in_bytes / GIB, mem.temp_size_in_bytes / GIB, peak / GIB,
            seconds)


def measure(config: str, preset: str, topology: str, mesh_sizes: dict[str, int] | None,
            layers: int, dispatch: str | None = None, numerics: str = "default"):
    """The table's rows: ``(function, KV slots per device, arguments, temporaries, peak,
    compile s)``, and a description of the run (``numerics``: ``ModelConfig.numerics``)."""
    cfg = load_config(str(Path(__file__).resolve().parents[1] / "configs" / f"{config}.py"))
    model_cfg = get_config(preset, dtype=cfg.model.dtype,
                           param_dtype=cfg.model.param_dtype, numerics=numerics)
    if layers:
        model_cfg = model_cfg.replace(num_hidden_layers=layers)
    if dispatch:
        model_cfg = model_cfg.replace(expert_dispatch=dispatch)
    devices = jax.devices() if topology == "cpu" else topology_devices(topology)
    sizes = mesh_sizes or {a: cfg.mesh[a] for a in ("data", "fsdp", "expert", "context",
                                                    "tensor") if a in cfg.mesh}
    mesh = make_mesh(sizes, devices=devices)
    mdef = state.ModelDef.of(model_cfg)
    placement = Placement(mesh, mdef)
    r = cfg.rollout
    prompts, group, steps = r.prompts_per_step, r.group_size, r.max_new_tokens
    width, rows = cfg.data.max_prompt_len, r.prompts_per_step * r.group_size
    n = placement.batch_shards
    vocab = model_cfg.vocab_size
    gen = rollout.Generator(mdef, max_new_tokens=steps, stop_ids=(0,), num_valid=vocab,
                            placement=placement, engine="reference")
    params = placement.abstract_params()
    key = jax.eval_shape(lambda: jax.random.key(0))
    trunc = tuple(jax.ShapeDtypeStruct((), t) for t in (jnp.int32, jnp.float32,
                                                         jnp.float32))
    temp = jax.ShapeDtypeStruct((), jnp.float32)
    by_rows = NamedSharding(mesh, P(present(mesh, BATCH_AXES)))
    rep = NamedSharding(mesh, P())

    def ints(*shape, sharding=by_rows, dtype=jnp.int32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    out = []
    kv_heads, head_dim = model_cfg.num_key_value_heads, model_cfg.head_dim
    with jax.set_mesh(mesh):
        ref = gen.engine_for(False).compiled("decode").lower(params, ints(prompts, width), ints(prompts),
                                   ints(rows), ints(rows), ints(rows), ints(rows),
                                   ints(sharding=rep), key, temp, trunc)
        out.append(("reference: whole decode", rows // n * (width + steps), *_memory(ref)))
        compact = rollout.Generator(mdef, max_new_tokens=steps, stop_ids=(0,),
                                    num_valid=vocab, placement=placement,
                                    page_size=r.page_size, decode_chunk=r.decode_chunk,
                                    max_decode_rows=r.max_decode_rows).engine_for(False)
        size, chunk = r.page_size, r.decode_chunk
        per = rows // n  # rows per shard; its prompts: per / G (at least one)
        local_prompts = max(1, -(-per // group))
        prompt_pages = local_prompts * (width // size) + per * bool(width % size)
        pages_of = {"start": prompt_pages + per * -(-chunk // size)}
        for name, written in (("T/4 written", steps // 4), ("T written", steps)):
            pages_of[name] = prompt_pages + per * -(-(written + chunk) // size)
        dtype = jnp.dtype(model_cfg.dtype)
        def pools(pages):
            one = jax.ShapeDtypeStruct((n * pages, kv_heads, size, head_dim), dtype,
                                       sharding=by_rows)
            return ((one,) * model_cfg.num_hidden_layers,) * 2

        record = tuple(ints(rows, steps, dtype=t) for t in (jnp.int32, jnp.float32,
                                                             jnp.float32, jnp.float32))
        record = (*record, ints(rows), ints(rows, dtype=jnp.bool_))
        fields = [ints(rows)] * 7 + [ints(rows, dtype=jnp.bool_)] * 2
        pre = compact.compiled("prefill", rows).lower(
            params, pools(pages_of["start"]), ints(n * local_prompts, width),
            ints(n * local_prompts), ints(n * prompt_pages), ints(n * prompt_pages),
            ints(rows), ints(rows), ints(rows), ints(rows), ints(rows), key, temp, trunc)
        out.append(("compact: prefill", pages_of["start"] * size, *_memory(pre)))
        table = -(-(width + steps) // size)
        for name in ("T/4 written", "T written"):
            fn = compact.compiled("chunk", (rows, True))
            low = fn.lower(params, pools(pages_of[name]), Rows(*fields),
                           ints(rows, table), record, key, ints(sharding=rep),
                           ints(sharding=rep), temp, trunc)
            out.append((f"compact: decode chunk, {name}", pages_of[name] * size,
                        *_memory(low)))
    where = (f"{config}: {preset} ({model_cfg.num_hidden_layers} layers, "
             f"{model_cfg.dtype} compute, {model_cfg.param_dtype} parameters, expert "
             f"dispatch {model_cfg.expert_dispatch}, numerics {model_cfg.numerics}), mesh "
             + " x ".join(f"{k}={v}" for k, v in mesh.shape.items() if v > 1)
             + f" on {'XLA:CPU' if topology == 'cpu' else topology}; {prompts} prompts x "
             f"G = {group} ({rows} rows, {per} per device), prompts of {width} tokens, T = {steps}, page size {size}, decode "
             f"chunk {chunk}")
    return out, where


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="grpo_qwen3_30b_a3b")
    p.add_argument("--preset", default="qwen3-30b-a3b",
                   help="the model (the config loads it from a checkpoint)")
    p.add_argument("--topology", default="v6e:8x8",
                   help="a TPU slice, or cpu: this host's devices (XLA:CPU's numbers)")
    p.add_argument("--mesh", default=None, help="axis=size,... (default: the config's)")
    p.add_argument("--layers", type=int, default=0, help="override the layer count")
    p.add_argument("--dispatch", default=None,
                   help="expert_dispatch (default: the preset's); v5e needs dense: its "
                        "limited ICI routing has no ragged all-to-all")
    p.add_argument("--numerics", default="default",
                   help="ModelConfig.numerics (invariant: one device, --mesh data=1)")
    args = p.parse_args(argv)
    try:
        sizes = None if args.mesh is None else parse_mesh(args.mesh)
    except ValueError as e:
        p.error(str(e))
    rows, where = measure(args.config, args.preset, args.topology, sizes, args.layers,
                          args.dispatch, args.numerics)
    print(describe())
    print(where)
    print()
    print("| function | KV slots per device | arguments GiB | temporaries GiB | peak GiB "
          "| compile s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, slots, arg, tmp, peak, secs in rows:
        print(f"| {name} | {slots:,} | {arg:.3g} | {tmp:.3g} | {peak:.3g} | {secs:.0f} |")


if __name__ == "__main__":
    main()
