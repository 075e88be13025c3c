"""Per-device memory of a sharded RL train step, from XLA's compiled memory analysis
(``measure``; ``benchmarks/memory.py`` prints it as tables, the TPU-compile tests check it).

Nothing is allocated: the step is lowered on abstract shapes (``jax.ShapeDtypeStruct``)
for a mesh of fake CPU devices, or of a TPU slice's devices (``topology``: the real TPU
compiler, needs ``libtpu``), and compiled; ``Compiled.memory_analysis()`` then gives the
per-device sizes of XLA's buffer assignment. The step is GRPO-shaped: decoder forward
(expert-parallel MoE), sharded jaxhead head on the kept tokens,
``-mean(adv * logp) + aux`` loss, backward, ``optax.adam`` update (float32 ``m`` and
``v`` like the float32 parameters), with the parameters and optimizer state donated.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import time

GIB = 2**30


def _shard_bytes(abstract, shardings) -> int:
    """Bytes one device holds of the arrays ``abstract`` laid out by ``shardings``."""
    import jax

    return sum(
        math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
        for a, s in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings), strict=True)
    )


def measure(preset: str, mesh_sizes: dict[str, int], *, batch: int, seq: int, keep: float,
            layers: int, vocab_axis: str | None = None, remat: bool = False,
            topology: str | None = None, scan: bool = True, dispatch: str = "dense",
            capacity_factor: float | None = None) -> dict:
    """Compile the train step for ``mesh_sizes`` on abstract shapes; per-device GiB and
    the lower + compile seconds. ``topology``: a TPU slice name (``"v6e:8x8"``) to compile
    for with the TPU compiler (the mesh's devices are its first ones); None: the host's
    (fake) CPU devices. ``scan=False`` turns the preset's ``scan_layers`` off.
    ``dispatch``, ``capacity_factor``: ``ModelConfig.expert_dispatch`` /
    ``expert_capacity_factor``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jaxhead
    from models import Transformer, get_config, jit_sharded, state_shardings
    from models.mesh import BATCH_AXES, axis_size, batch_sharding, make_mesh, present

    cfg = get_config(preset, dtype="bfloat16", param_dtype="float32", remat=remat)
    cfg = cfg.replace(scan_layers=cfg.scan_layers and scan, expert_dispatch=dispatch,
                      expert_capacity_factor=capacity_factor)
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers)
    devices = jax.devices() if topology is None else _topology_devices(topology)
    mesh = make_mesh(mesh_sizes, devices=devices[: math.prod(mesh_sizes.values())])
    shards = axis_size(mesh, BATCH_AXES)
    batch = batch or shards
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    p_shard = state_shardings(params, mesh)
    tx = optax.adam(1e-6, b1=0.9, b2=0.999, eps=1e-8, mu_dtype=jnp.float32)
    opt = jax.eval_shape(tx.init, params)
    # each moment placed like its parameter (optax builds them by mapping over the
    # parameters), the step counter replicated
    o_shard = optax.tree_utils.tree_map_params(
        tx, lambda _, s: s, opt, p_shard, transform_non_params=lambda _: NamedSharding(mesh, P()))
    per_shard = batch * seq // shards
    bucket = jaxhead.bucket_size(math.ceil(keep * per_shard), per_shard)
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    data = {"tokens": tokens, "positions": tokens, "segment_ids": tokens, "labels": tokens,
            "keep": jax.ShapeDtypeStruct((batch, seq), jnp.bool_),
            "advantages": jax.ShapeDtypeStruct((batch, seq), jnp.float32)}

    def loss_fn(params, data, sharded=True, bucket=bucket):
        model = nnx.merge(graphdef, params)
        out = model(data["tokens"], data["positions"], data["segment_ids"])
        if sharded:
            head = model.lm_head.sharded(out.hidden, data["labels"], data["keep"],
                                         token_axes=present(mesh, BATCH_AXES),
                                         bucket=bucket, vocab_axis=vocab_axis)
        else:  # one device's share: its tokens through the plain head
            head = model.lm_head(out.hidden, data["labels"], data["keep"], bucket=bucket)
        count = jnp.maximum(jnp.sum(data["keep"]), 1)
        return (-jnp.sum(data["advantages"] * head.logprobs) / count
                + cfg.router_aux_loss_coef * out.aux_loss)

    def step(params, opt_state, data):
        loss, grads = jax.value_and_grad(loss_fn)(params, data)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    b_shard = batch_sharding(mesh)
    run = jit_sharded(step, mesh, in_shardings=(p_shard, o_shard, b_shard),
                      out_shardings=(p_shard, o_shard, None), donate_argnums=(0, 1))
    with tempfile.TemporaryDirectory() as dump:  # the buffer assignment, as text
        start = time.perf_counter()
        lowered = run.lower(params, opt, data)
        compiled = lowered.compile(
            {"xla_dump_to": dump, "xla_dump_hlo_as_text": True,
             "xla_dump_hlo_module_re": "step"})
        seconds = time.perf_counter() - start
        largest = largest_temporaries(_buffer_assignment(dump))
    mem = compiled.memory_analysis()
    # activations are split over the batch axes: one device's rows, traced unsharded, at
    # the step's tokens and at half of them; what grows with the tokens is activations,
    # the rest compute-dtype weight copies (at full, unsharded size)
    rows = max(batch // shards, 1)

    def saved_at(tokens):
        local = {k: jax.ShapeDtypeStruct((rows, tokens), v.dtype) for k, v in data.items()}
        b = jaxhead.bucket_size(math.ceil(keep * rows * tokens), rows * tokens)
        return saved_activation_bytes(
            lambda p, d: loss_fn(p, d, sharded=False, bucket=b), params, local)

    saved, top_saved = saved_at(seq)
    activations = 2 * (saved - saved_at(seq // 2)[0])  # linear in the tokens
    param_bytes = _shard_bytes(params, p_shard)  # exact: the shards' sizes
    adam_bytes = _shard_bytes(opt, o_shard)
    peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes)
    return {
        "preset": preset + (f" ({layers} layers)" if layers else "")
        + (", remat" if remat else "") + (", scan" if cfg.scan_layers else ""),
        "mesh": (" x ".join(f"{k}={v}" for k, v in mesh_sizes.items() if v > 1) or "1")
        + (f", vocab over {vocab_axis}" if vocab_axis else ""),
        "devices": math.prod(mesh_sizes.values()), "tokens": per_shard,
        "target": "CPU (approximation)" if topology is None else f"TPU compiler ({topology})",
        "dispatch": dispatch + (f", factor {capacity_factor:g}" if capacity_factor
                                and dispatch == "ragged" else "")
        + (" (emulated)" if dispatch == "ragged" and topology is None else ""),
        "params": param_bytes / GIB, "adam": adam_bytes / GIB,
        "temp": mem.temp_size_in_bytes / GIB, "peak": peak / GIB, "compile": seconds,
        "saved": activations / GIB, "weight_copies": (saved - activations) / GIB,
        "largest_saved": top_saved,
        "largest": largest,
        # Mosaic kernels (TPU: the Pallas head's forward / dh / dW, splash attention's
        # forward / dq / dkv; one of each however many layers the scan runs)
        "kernels": lowered.as_text().count("tpu_custom_call"),
    }


def saved_activation_bytes(loss_fn, params, data) -> tuple[int, list[str]]:
    """Bytes the forward of ``loss_fn(params, data)`` saves for its backward, besides the
    arguments themselves (``jax.ad_checkpoint``'s residual analysis on abstract shapes),
    and the three largest residuals as ``"<MiB> MiB <shape> (<source>)"``."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' data

    res = [(a.size * a.dtype.itemsize, a.str_short(), why)
           for a, why in saved_residuals(loss_fn, params, data) if "argument" not in why]
    res.sort(key=lambda r: -r[0])
    return sum(r[0] for r in res), [f"{b / 2**20:.3g} MiB {s}" for b, s, _ in res[:3]]


_ALLOCATION = re.compile(r"^allocation \d+: size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (\S+)")


def largest_temporaries(buffer_assignment: str, count: int = 3) -> list[str]:
    """The ``count`` largest values XLA placed in temporary buffers of device memory, from
    a compiled module's buffer-assignment dump (``*buffer-assignment.txt`` of
    ``xla_dump_to``; per device after SPMD partitioning): ``"<MiB> MiB <shape>
    (<instruction>)"``, largest first. Parameters, outputs, constants, thread-local
    scalars and other memory spaces (TPU VMEM, SMEM: ``color`` > 0) are left out."""
    values, temp = {}, False
    for line in buffer_assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            kind = m.group(2)
            color = re.search(r", color (\d+),", kind)
            temp = (color is None or color.group(1) == "0") and not any(
                k in kind for k in ("parameter", "output shape", "constant", "thread-local"))
            continue
        m = _VALUE.match(line)
        if temp and m:
            name, size, shape = m.group(1), int(m.group(2)), m.group(3).split("{")[0]
            values[name] = max(values.get(name, (0, ""))[0], size), shape
    top = sorted(values.items(), key=lambda kv: -kv[1][0])[:count]
    return [f"{b / 2**20:.3g} MiB {shape} ({name})" for name, (b, shape) in top]


def _buffer_assignment(dump_dir: str) -> str:
    """The buffer assignment of the largest module XLA dumped into ``dump_dir``."""
    files = [os.path.join(dump_dir, f) for f in os.listdir(dump_dir)
             if f.endswith("after_optimizations-buffer-assignment.txt")]
    if not files:
        return ""
    with open(max(files, key=os.path.getsize)) as f:
        return f.read()


def _topology_devices(name: str):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's machine-wide lock
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu").devices
