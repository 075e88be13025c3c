"""Per-device memory of a sharded RL train step, from XLA's compiled memory analysis
(``measure``; ``benchmarks/memory.py`` prints it as tables, the TPU-compile tests check it).

Nothing is allocated: the step is lowered on abstract shapes (``jax.ShapeDtypeStruct``)
for a mesh of fake CPU devices, or of a TPU slice's devices (``topology``: the real TPU
compiler, needs ``libtpu``), and compiled; ``Compiled.memory_analysis()`` then gives the
per-device sizes of XLA's buffer assignment. The step is the trainer's own
(``train.rl.steps.grpo_step`` under a ``train.rl.placement.Placement``): decoder forward
(expert-parallel MoE), the head per token shard on the kept tokens (with entropy), the
clipped GRPO loss plus the load-balancing loss, backward, the optimizer update,
parameters and optimizer state donated. The model's compute and parameter dtypes, the
optimizer (``train.rl.optim.make_optimizer``: global-norm clipping then AdamW, its moments in
the parameters' dtype) and the loss settings are those of a shipped trainer config
(``shipped``; ``configs/grpo_qwen3_30b_a3b.py`` by default): what the tables measure is
what the config trains.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tempfile
import time

GIB = 2**30


def _shard_bytes(abstract) -> int:
    """Bytes one device holds of the arrays ``abstract`` (``ShapeDtypeStruct`` s with
    their shardings)."""
    import jax

    return sum(math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
               for a in jax.tree.leaves(abstract))


#: The trainer config whose settings ``measure`` uses unless told otherwise.
CONFIG = "grpo_qwen3_30b_a3b"


def parse_mesh(text: str) -> dict[str, int]:
    """A benchmark's ``--mesh``: ``"fsdp=8,expert=8"`` -> ``{"fsdp": 8, "expert": 8}``.

    Raises:
      ValueError: a part that is not ``axis=size`` with a named axis and an integer size
        >= 1, or an axis named twice (the part named).
    """
    sizes = {}
    for part in filter(None, text.split(",")):
        name, _, value = (s.strip() for s in part.partition("="))
        if not name or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--mesh {text!r}: {part!r} is not axis=size with a size >= 1")
        if name in sizes:
            raise ValueError(f"--mesh {text!r}: axis {name!r} is named twice")
        sizes[name] = int(value)
    return sizes


def shipped(config: str = CONFIG) -> dict:
    """The settings of ``configs/<config>.py`` a train step's memory depends on: ``dtype``
    and ``param_dtype`` (the model's), ``tx`` (its GRPO stage's optimizer) and ``loss``
    (``train.rl.rl_loss.LossConfig``).

    Raises:
      FileNotFoundError: no such config file (named).
    """
    from pathlib import Path

    from train.config.cli import load_config
    from train.rl import updates
    from train.rl.optim import make_optimizer

    path = Path(__file__).resolve().parents[1] / "configs" / f"{config}.py"
    if not path.is_file():
        raise FileNotFoundError(f"no trainer config {str(path)!r}")
    cfg = load_config(str(path))
    t = cfg.train
    tx, _ = make_optimizer(t.optim, t.steps, t.updates_per_batch * t.mini_batches)
    return {"dtype": cfg.model.dtype, "param_dtype": cfg.model.param_dtype, "tx": tx,
            "loss": updates.loss_config(cfg.loss, cfg.rollout.max_new_tokens)}


def measure(preset: str, mesh_sizes: dict[str, int], *, batch: int, seq: int, keep: float,
            layers: int, remat: bool = False, remat_policy: str = "nothing_saved",
            topology: str | None = None, scan: bool = True, dispatch: str = "dense",
            capacity_factor: float | None = None, moe_token_chunk: int | None = None,
            config: str = CONFIG, numerics: str = "default") -> dict:
    """Compile the trainer's GRPO step (``train.rl.steps.grpo_step``: its loss, its head on the
    kept tokens, its placement) for ``mesh_sizes`` on abstract shapes; per-device GiB and
    the lower + compile seconds.

    Args:
      preset: a ``models.get_config`` name, with the dtypes of ``config``.
      mesh_sizes: ``models.mesh`` axis sizes (their product: the devices used).
      batch: global sequences (0: one per batch shard); seq: tokens per sequence (split
        over the mesh's ``context`` axis, if it has one).
      keep: the fraction of tokens a loss reads (each token shard's bucket).
      layers: overrides ``num_hidden_layers`` (0: the preset's).
      remat: recompute each decoder layer in the backward; remat_policy: what it saves
        (``ModelConfig.remat_policy``; ``"offload"`` keeps the layer inputs in host memory,
        reported as ``host_temp``).
      topology: a TPU slice name (``"v6e:8x8"``) to compile for with the TPU compiler
        (the mesh's devices are its first ones); None: the host's (fake) CPU devices.
      scan: False turns the preset's ``scan_layers`` off.
      dispatch, capacity_factor, moe_token_chunk: ``ModelConfig.expert_dispatch`` /
        ``expert_capacity_factor`` / ``moe_token_chunk``.
      config: the trainer config (``configs/<config>.py``) whose dtypes, optimizer and
        loss settings the step uses (``shipped``).
      numerics: ``ModelConfig.numerics`` (``"invariant"``: on a one-device mesh).

    Returns:
      a dict of the table's columns (``benchmarks/memory.py``): sizes in GiB per device.
    """
    import jax
    import jax.numpy as jnp

    import jaxhead
    from models import context, get_config
    from models.mesh import make_mesh
    from train.rl import state, steps
    from train.rl.placement import Placement

    settings = shipped(config)
    cfg = get_config(preset, dtype=settings["dtype"], param_dtype=settings["param_dtype"],
                     remat=remat, remat_policy=remat_policy, numerics=numerics)
    cfg = cfg.replace(scan_layers=cfg.scan_layers and scan, expert_dispatch=dispatch,
                      expert_capacity_factor=capacity_factor, moe_token_chunk=moe_token_chunk)
    if layers:
        cfg = cfg.replace(num_hidden_layers=layers)
    devices = jax.devices() if topology is None else topology_devices(topology)
    mesh = make_mesh(mesh_sizes, devices=devices[: math.prod(mesh_sizes.values())])
    mdef = state.ModelDef.of(cfg)
    placement = Placement(mesh, mdef)
    shards = placement.batch_shards
    batch = batch or shards
    tx, loss_cfg = settings["tx"], settings["loss"]
    abstract = placement.abstract_state(tx)
    params, opt = abstract["params"], abstract["opt_state"]
    split = context.context_size(mesh)  # a row's tokens over the context axis
    per_shard = batch * seq // (shards * split)  # tokens per device
    bucket = jaxhead.bucket_size(math.ceil(keep * per_shard), per_shard)

    def batch_of(rows, tokens, sharding=None):
        def arr(dtype):
            return jax.ShapeDtypeStruct((rows, tokens), dtype, sharding=sharding)
        return {"tokens": arr(jnp.int32), "positions": arr(jnp.int32),
                "segment_ids": arr(jnp.int32), "labels": arr(jnp.int32),
                "loss_mask": arr(jnp.float32), "seq_index": arr(jnp.int32),
                "old_logp": arr(jnp.float32), "advantages": arr(jnp.float32)}

    run = steps.grpo_step(mdef, tx, loss_cfg, placement, temperature=1.0)
    # kernels are chosen for the mesh's chips: a one-device step is traced with no mesh in
    # context, where "auto" (and its lowering probe) would follow the CPU host's backend
    target = (jax.set_mesh(mesh) if topology is not None and not placement.sharded
              else contextlib.nullcontext())
    with tempfile.TemporaryDirectory() as dump, target:  # the buffer assignment, as text
        start = time.perf_counter()
        lowered = run.lower(params, opt, (batch_of(batch, seq, placement.batch),), None, batch,
                            bucket)
        try:
            compiled = lowered.compile(
                {"xla_dump_to": dump, "xla_dump_hlo_as_text": True,
                 "xla_dump_hlo_module_re": "step"})
        except Exception as err:  # only the compiler's out-of-memory becomes a row
            oom = out_of_memory(str(err))
            if oom is None:
                raise
            compiled = None
        seconds = time.perf_counter() - start
        largest = [] if compiled is None else largest_temporaries(_buffer_assignment(dump))
    # activations are split over the batch axes (and a row's tokens over context): one
    # device's rows and tokens, traced unsharded (the plain head), at the step's tokens and
    # at half of them; what grows with the tokens is activations, the rest compute-dtype
    # weight copies (at full, unsharded size)
    rows = max(batch // shards, 1)
    loss_fn = steps.grpo_loss_fn(mdef, loss_cfg, 1.0, skip=True)
    local_params = mdef.abstract_params()

    def saved_at(tokens):
        b = jaxhead.bucket_size(math.ceil(keep * rows * tokens), rows * tokens)
        return saved_activation_bytes(lambda p, d: loss_fn(p, d, None, rows, b)[0],
                                      local_params, batch_of(rows, tokens))

    saved, top_saved = saved_at(seq // split)
    activations = 2 * (saved - saved_at(seq // split // 2)[0])  # linear in the tokens
    param_bytes = _shard_bytes(params)  # exact: the shards' sizes
    adam_bytes = _shard_bytes(opt)
    if compiled is None:
        host_temp = 0
        temp, peak, fits = oom[0] * GIB, None, f"no: needs {oom[0]:.3g} GiB of temporaries, "
        fits += f"{oom[1]:.4g} available"
    else:
        mem = compiled.memory_analysis()
        temp, fits = mem.temp_size_in_bytes, "yes"
        host_temp = mem.host_temp_size_in_bytes  # offloaded residuals (pinned host)
        peak = (mem.argument_size_in_bytes + mem.temp_size_in_bytes
                + mem.output_size_in_bytes - mem.alias_size_in_bytes)
    return {
        "preset": preset + (f" ({layers} layers)" if layers else "")
        + ((", remat" if remat_policy == "nothing_saved" else f", remat {remat_policy}")
           if remat else "") + (", scan" if cfg.scan_layers else ""),
        "config": config, "dtype": cfg.dtype, "param_dtype": cfg.param_dtype,
        "mesh": " x ".join(f"{k}={v}" for k, v in mesh_sizes.items() if v > 1) or "1",
        "devices": math.prod(mesh_sizes.values()), "tokens": per_shard,
        "target": "CPU (approximation)" if topology is None else f"TPU compiler ({topology})",
        "dispatch": dispatch + (f", factor {capacity_factor:g}" if capacity_factor
                                and dispatch == "ragged" else "")
        + (" (emulated)" if dispatch == "ragged" and topology is None else "")
        + (f", chunks of {moe_token_chunk}" if moe_token_chunk else ""),
        "params": param_bytes / GIB, "adam": adam_bytes / GIB,
        "temp": temp / GIB, "host_temp": host_temp / GIB, "peak": None if peak is None else peak / GIB, "fits": fits,
        "compile": seconds,
        "saved": activations / GIB, "weight_copies": (saved - activations) / GIB,
        "largest_saved": top_saved,
        "largest": largest,
        # Mosaic kernels (TPU: the Pallas head's forward / dh / dW, splash attention's
        # forward / dq / dkv; one of each however many layers the scan runs)
        "kernels": lowered.as_text().count("tpu_custom_call"),
    }


_HBM_OOM = re.compile(r"temporaries \(([\d.]+)([KMGT])\) exceeds available HBM "
                      r"\(([\d.]+)([KMGT])\)")


def out_of_memory(message: str) -> tuple[float, float] | None:
    """``(needed, available)`` GiB of the TPU compiler's ``CompileTimeHbmOom`` error
    (``"... the total memory required for HLO temporaries (19.90G) exceeds available HBM
    (15.75G)"``; XLA's ``G`` is GiB), None for any other error."""
    m = _HBM_OOM.search(message)
    if m is None:
        return None
    scale = {"K": 2**-20, "M": 2**-10, "G": 1.0, "T": 2**10}
    return float(m.group(1)) * scale[m.group(2)], float(m.group(3)) * scale[m.group(4)]


def saved_activation_bytes(loss_fn, params, data) -> tuple[int, list[str]]:
    """Bytes the forward of ``loss_fn(params, data)`` saves for its backward, besides the
    arguments themselves (``jax.ad_checkpoint``'s residual analysis on abstract shapes),
    and the three largest residuals as ``"<MiB> MiB <shape> (<source>)"``."""
    from jax._src.ad_checkpoint import saved_residuals  # print_saved_residuals' data

    res = [(a.size * a.dtype.itemsize, a.str_short(), why)
           for a, why in saved_residuals(loss_fn, params, data) if "argument" not in why]
    res.sort(key=lambda r: -r[0])
    return sum(r[0] for r in res), [f"{b / 2**20:.3g} MiB {s}" for b, s, _ in res[:3]]


_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+)(.*):$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def largest_temporaries(buffer_assignment: str, count: int = 3) -> list[str]:
    """The ``count`` largest buffers XLA placed among the temporaries of device memory,
    from a compiled module's buffer-assignment dump (``*buffer-assignment.txt`` of
    ``xla_dump_to``; per device after SPMD partitioning): ``"<MiB> MiB <shape>
    (<instruction> = <instruction>...)"``, largest first. Values at the same offset of the
    same allocation with the same size are one buffer, listed once with every name (e.g. a
    scan's stacked residuals: the ``AllocateBuffer`` custom call and the in-place
    ``dynamic-update-slice`` that fills it). Parameters, outputs, constants, thread-local
    scalars and other memory spaces (TPU VMEM, SMEM: ``color`` > 0) are left out."""
    places, temp, allocation = {}, False, None
    for line in buffer_assignment.splitlines():
        m = _ALLOCATION.match(line)
        if m:
            allocation, kind = m.group(1), m.group(3)
            color = re.search(r", color (\d+),", kind)
            temp = (color is None or color.group(1) == "0") and not any(
                k in kind for k in ("parameter", "output shape", "constant", "thread-local"))
            continue
        m = _VALUE.match(line)
        if temp and m:
            name, size, offset = m.group(1), int(m.group(2)), int(m.group(3))
            shape, names = places.setdefault((allocation, offset, size),
                                             (m.group(4).split("{")[0], []))
            if name not in names:
                names.append(name)
    rows, seen = [], set()
    for (_, _, size), (shape, names) in sorted(places.items(), key=lambda kv: -kv[0][2]):
        if seen.intersection(names):  # a value under several places counts once
            continue
        seen.update(names)
        rows.append(f"{size / 2**20:.3g} MiB {shape} ({' = '.join(names)})")
    return rows[:count]


def _buffer_assignment(dump_dir: str) -> str:
    """The buffer assignment of the largest module XLA dumped into ``dump_dir``."""
    files = [os.path.join(dump_dir, f) for f in os.listdir(dump_dir)
             if f.endswith("after_optimizations-buffer-assignment.txt")]
    if not files:
        return ""
    with open(max(files, key=os.path.getsize)) as f:
        return f.read()


def topology_devices(name: str):
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # libtpu's machine-wide lock
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=name, platform="tpu").devices
