"""Hugging Face checkpoints: load a local directory of one of the families of
``models.hf.families`` (``Qwen3ForCausalLM``, ``Qwen3MoeForCausalLM``, ``Qwen2ForCausalLM``
for Qwen2 / Qwen2.5 and their derivatives, ``LlamaForCausalLM`` for Llama 3) into a
``Transformer`` and export one back (``config.json`` + safetensors).

This module reads and writes the files, the same for every family; what differs between
families is their record (``models.hf.family.Family``: config mapping, tensor names and
layouts, export config), one file each under ``models/hf/families/``.

Tensor layout (``models.hf.layout``): HF linear weights are ``[out, in]``; ours are
``[in..., out...]`` with the head dimensions split (``q_proj`` ``[H, N, D]``, ``o_proj``
``[N, D, H]``) and MoE experts stacked on a leading ``[E]`` axis (HF stores
``mlp.experts.{e}.*`` per expert, the layout the export writes; the import also reads
transformers 5's fused ``mlp.experts.gate_up_proj`` / ``down_proj``, ``models.hf.fused``).
With ``ModelConfig.scan_layers`` the layers are stacked too, on a leading ``[L]`` axis
before the expert one (HF stores ``model.layers.{i}.*`` per layer). Qwen2's q/k/v biases
are ``[N, D]`` / ``[K, D]`` here, flat ``[N*D]`` / ``[K*D]`` in the files.

Import on a mesh (``load_params`` with shardings, ``load_model(mesh=...)``): each process
reads from the files only the slices of the parameters its own devices hold
(``safe_open(...).get_slice``), mapped through those transposes and stackings.

Export from a mesh (``save_params``): the files are split into shards and shard ``s`` is
written by process ``s % process_count``; see ``save_params`` for what moves between the
processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh
from safetensors import safe_open
from safetensors.numpy import save_file

from models import export_dir
from models.config import ModelConfig
from models.export_dir import INDEX_FILE
from models.hf.family import EMBEDDING, LM_HEAD, CheckpointError
from models.hf.files import check_tensors, tensor_files
from models.hf.fused import FusedExpert, fused_experts, fused_names
from models.hf.layout import Tensor, index_ranges
from models.hf.mapping import (
    architecture,
    config_from_hf,
    config_to_hf,
    family_of,
    hf_tensors,
    tensor_map,
)
from models.sharding import state_shardings
from models.transformer import Transformer

__all__ = [
    "CheckpointError",
    "architecture",
    "config_from_hf",
    "config_to_hf",
    "hf_tensors",
    "load_config",
    "load_model",
    "load_params",
    "save_model",
    "save_params",
]

# the names the tests of the slice reads and of the fused layout reach for
_Tensor, _Fused = Tensor, FusedExpert


def load_config(path, *, dtype="bfloat16", param_dtype="float32",
                scan_layers: bool = False) -> ModelConfig:
    """``config_from_hf`` of ``path/config.json``, with ``scan_layers`` set (the stacked
    layer layout, see ``ModelConfig``).

    Raises:
      FileNotFoundError: no ``config.json``. CheckpointError: see ``config_from_hf``.
      ValueError: ``scan_layers`` with mixed dense / MoE layers (see ``ModelConfig``).
    """
    hf = json.loads((Path(path) / "config.json").read_text())
    return config_from_hf(hf, dtype=dtype, param_dtype=param_dtype).replace(
        scan_layers=scan_layers)


def load_params(path, cfg: ModelConfig, shardings=None) -> dict[tuple, jax.Array]:
    """The parameters of ``Transformer(cfg)`` from a local HF checkpoint directory, each
    built by ``jax.make_array_from_callback`` in its ``sharding``: a process reads from the
    files only the slices its own devices hold (each distinct slice once), never a whole
    tensor unless one of its devices holds all of it (replicated ones, e.g. the norms on a
    mesh without ``fsdp``). A slice of a stacked (``[L]`` layers, ``[E]`` experts) or
    transposed, head-split kernel is read as the matching slices of the stacked files'
    tensors (see ``models.hf.layout.Tensor.read``). Tensors of any float dtype are converted to
    ``cfg.param_dtype`` (bfloat16 rounds to nearest even).

    A Qwen3-MoE layer's experts are read in either layout, per expert
    (``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj`` ``[H,
    I]``: what transformers 4 and 5 write and vLLM reads) or fused as transformers 5 holds
    them in memory (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, each expert's gate rows
    then its up rows, and ``mlp.experts.down_proj`` ``[E, H, I]``); a slice of an expert
    is then read from the fused tensor's rows.

    Args:
      path: the checkpoint directory: ``model.safetensors``, several ``*.safetensors``, or
        shards listed by ``model.safetensors.index.json`` (``config.json`` is not read:
        ``cfg`` describes the model, e.g. ``load_config(path)``).
      cfg: the model's config.
      shardings: parameter path (as in ``nnx.to_flat_state``) -> ``jax.sharding.Sharding``
        (e.g. ``models.state_shardings`` over a mesh, which may span several processes);
        None: every parameter whole on the default device ``jax.local_devices()[0]``.

    Returns:
      ``{path: jax.Array}`` of every parameter, its shape in our layout (e.g. ``q_proj``
      ``[H, N, D]``, or ``[L, H, N, D]`` with ``cfg.scan_layers``), dtype
      ``cfg.param_dtype``.

    Raises:
      CheckpointError: a tensor the config requires is missing (key and expected shape
        named; an expert's in neither layout); a tensor's shape disagrees with the config
        (key, file, expected and found shapes named); experts stored in both layouts;
        tensors the model does not use; ``lm_head.weight`` present in a
        tied checkpoint but different from the embedding (each process compares the
        slices it reads).
      KeyError: ``shardings`` lacks a parameter (its path named).
    """
    path = Path(path)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    family, tensors = family_of(cfg), tensor_map(cfg)
    expected = {key: t.hf_shape(var.shape) for p, var in params
                for t in [tensors[p]] for key in t.keys}
    key_files = tensor_files(path)
    tied_head = cfg.tie_word_embeddings and LM_HEAD in key_files
    if tied_head:
        expected[LM_HEAD] = (cfg.vocab_size, cfg.hidden_size)
    dtype = jnp.dtype(cfg.param_dtype)
    default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    out = {}
    with contextlib.ExitStack() as stack:
        handles = {file: stack.enter_context(safe_open(file, framework="np"))
                   for file in sorted(set(key_files.values()))}
        fused = fused_experts(family, cfg, handles, key_files)
        check_tensors(path, handles, key_files, expected, fused, fused_names(family, cfg))

        def get(key: str, index: tuple[slice, ...]) -> np.ndarray:
            if key in fused:
                return fused[key].read(handles[key_files[fused[key].key]], index)
            return handles[key_files[key]].get_slice(key)[index]

        for p, var in params:
            t, shape, cache = tensors[p], tuple(var.shape), {}
            check_tied = tied_head and p == ("embed_tokens", "embedding")

            def block(index, t=t, shape=shape, cache=cache, check_tied=check_tied):
                where = tuple((r.start, r.stop) for r in index_ranges(index, shape))
                if where not in cache:
                    value = t.read(get, shape, index)
                    if check_tied and not np.array_equal(
                            value, Tensor((LM_HEAD,)).read(get, shape, index)):
                        raise CheckpointError(f"{path}: tie_word_embeddings is true but "
                                              f"{LM_HEAD} differs from {EMBEDDING}")
                    cache[where] = value.astype(dtype)
                return cache[where]

            if shardings is not None and p not in shardings:
                raise KeyError(f"no sharding for parameter {'/'.join(map(str, p))}")
            sharding = default if shardings is None else shardings[p]
            out[p] = jax.make_array_from_callback(shape, sharding, block)
    return out


def load_model(path, *, dtype="bfloat16", param_dtype="float32", scan_layers: bool = False,
               mesh: Mesh | None = None, rules=None) -> Transformer:
    """A ``Transformer`` with the weights of a local HF checkpoint directory
    (``load_config`` + ``load_params``). Parameters are never randomly initialised (the
    model is built abstractly, then filled).

    Args:
      path: the checkpoint directory (``config.json`` plus safetensors, see
        ``load_params``).
      dtype: compute dtype; param_dtype: parameter dtype (float32 or bfloat16 each).
      scan_layers: build the stacked-layer model (``ModelConfig.scan_layers``); the
        per-layer HF tensors are stacked on its leading ``[L]`` axis.
      mesh: place every parameter on this mesh (``models.state_shardings``; it may span
        several processes), each process reading only its devices' slices; None: whole
        tensors on the default device.
      rules: sharding rules (``models.sharding``), also set as the model config's
        ``sharding_rules``; None: the config's default.

    Returns:
      ``Transformer`` whose parameters are ``param_dtype`` arrays in their mesh layout (or
      on the default device).

    Raises:
      CheckpointError: unsupported architecture / setting, or a missing, extra or
        mis-shaped tensor (see ``load_params``).
      FileNotFoundError: no ``config.json``.
      ValueError: ``scan_layers`` with mixed dense / MoE layers; a parameter dimension not
        divisible by its mesh axes (named).
    """
    cfg = load_config(path, dtype=dtype, param_dtype=param_dtype, scan_layers=scan_layers)
    if rules is not None:
        cfg = cfg.replace(sharding_rules=rules)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    shardings = None
    if mesh is not None:
        placed = state_shardings(nnx.state(model, nnx.Param), mesh, cfg.sharding_rules)
        shardings = {p: v.get_value() for p, v in nnx.to_flat_state(placed)}
    nnx.update(model, nnx.from_flat_state(list(load_params(path, cfg, shardings).items())))
    return model


def _units(cfg: ModelConfig, path: tuple, shape: tuple[int, ...]) -> list[int | None]:
    """What ``save_params`` moves between processes at a time for parameter ``path``: one
    layer (index into the leading ``[L]`` axis) of a stacked parameter, else the whole
    parameter (None)."""
    return list(range(shape[0])) if cfg.scan_layers and path[0] == "layers" else [None]


def _gather(x: jax.Array, unit: int | None, dtype) -> np.ndarray:
    """``x[unit]`` (or all of ``x``) cast to ``dtype``, whole on this host. An array this
    process holds whole is read from its own shards; otherwise every process must call
    this (a collective): one jitted slice with a replicated output, the slice's
    all-reduce / all-gather moving only that slice (a static index: a traced one would
    gather the whole stacked array first)."""
    if x.is_fully_addressable or x.sharding.is_fully_replicated:
        value = x if x.is_fully_addressable else x.addressable_data(0)
        value = np.asarray(value if unit is None else value[unit])
        return value.astype(dtype)
    replicated = jax.sharding.NamedSharding(x.sharding.mesh, jax.sharding.PartitionSpec())
    take = jax.jit(lambda a: (a if unit is None else a[unit]).astype(dtype),
                   out_shardings=replicated)
    return np.asarray(take(x).addressable_data(0))


def _barrier(name: str) -> None:
    """Every process waits here for the others (nothing when there is one)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def save_params(params: dict[tuple, jax.Array], cfg: ModelConfig, path, *, dtype=None,
                max_shard_bytes: int = 5 * 2**30, metadata: dict | None = None,
                replace: bool = False,
                add_files: Callable[[Path], None] | None = None) -> list[Path]:
    """Write ``params`` as a HF checkpoint directory transformers (and vLLM) can load:
    ``config.json`` and ``model.safetensors``, or, above ``max_shard_bytes``,
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.

    The export owns ``path`` (``models.export_dir``): it is written into a staging
    directory beside it and moved into place when complete, replacing what was there
    whole, so no weight file or index of an earlier export survives (whatever its layout
    or dtype) and a failed export leaves the earlier one as it was. ``path`` must be
    missing, empty or a previous export unless ``replace`` is set; the check runs before
    anything is written.

    On several processes (a mesh spanning hosts) every process must call it with the
    same arguments: the shards are planned from the shapes alone, identically everywhere,
    and shard ``s`` is written by process ``s % jax.process_count()``. A parameter a
    process does not hold whole travels one unit at a time (one layer of a stacked
    ``[L, ...]`` parameter, else the whole parameter, e.g. the embedding): a jitted slice
    replicated to every device (the collective all processes join), kept by the process
    whose shard the unit's tensors fall in. So no host ever holds more than one unit plus
    the shard it is filling (<= ``max_shard_bytes``), never the whole model; the cost is
    network traffic: every unit reaches every host. Process 0 writes ``config.json`` and
    the index after a barrier, when every shard is on disk, then moves the directory into
    place (``path`` must be one directory every process sees, e.g. a shared file system);
    no process returns before it is there.

    Args:
      params: parameter path (as in ``nnx.to_flat_state``) -> array of the model of
        ``cfg``, in any sharding (e.g. the trainer's).
      cfg: the model's config.
      path: output directory.
      dtype: tensor dtype in the files, float32 or bfloat16 (``config.json``'s ``dtype``
        and ``torch_dtype``); default ``cfg.param_dtype``.
      max_shard_bytes: shard size limit (a tensor is never split).
      metadata: more ``config.json`` fields (e.g. ``bos_token_id`` / ``eos_token_id``),
        none of those the model's config determines.
      replace: replace ``path`` even if it is a file or a directory that holds no previous
        export (its contents are deleted once the new export is complete).
      add_files: called by process 0 with the staging directory once the weights and
        ``config.json`` are in it, before it is moved into place: the export's other files
        (e.g. the tokenizer's), which then appear together with the weights.

    Returns:
      The weight files this process wrote, at their final place under ``path``.

    Raises:
      CheckpointError: a config no HF architecture expresses (see ``architecture``).
      KeyError: ``params`` lacks a parameter of the model (its path named).
      ValueError: a ``dtype`` other than float32 / bfloat16; ``metadata`` setting a field
        the model's config determines (named).
      FileExistsError, ValueError: ``path`` may not be replaced (see
        ``models.export_dir.check_destination``).
    """
    dtype = jnp.dtype(cfg.param_dtype if dtype is None else dtype)
    if dtype not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise ValueError(f"export dtype {dtype.name!r}: float32 or bfloat16 only")
    hf_config = config_to_hf(cfg, dtype.name)
    clash = sorted(set(metadata or {}) & set(hf_config))
    if clash:
        raise ValueError(f"metadata sets {clash}, which config.json takes from the model "
                         "and the export dtype")
    hf_config.update(metadata or {})
    path = Path(path).absolute()  # "." has a parent to stage beside
    tensors = tensor_map(cfg)
    missing = sorted(set(tensors) - set(params), key=str)
    if missing:
        raise KeyError(f"no value for parameter {'/'.join(map(str, missing[0]))}")
    export_dir.check_destination(path, replace=replace)
    # the plan: (param path, unit, its HF keys and their bytes), then shards of whole tensors
    plan = []
    for p, t in tensors.items():
        shape = tuple(params[p].shape)
        units = _units(cfg, p, shape)
        per_unit = len(t.keys) // len(units)
        nbytes = math.prod(t.hf_shape(shape)) * dtype.itemsize
        for u, unit in enumerate(units):
            plan.append((p, unit, t.keys[u * per_unit:(u + 1) * per_unit], nbytes))
    shard_of, sizes = {}, [0]
    for _, _, keys, nbytes in plan:
        for key in keys:
            if sizes[-1] and sizes[-1] + nbytes > max_shard_bytes:
                sizes.append(0)
            shard_of[key] = len(sizes) - 1
            sizes[-1] += nbytes
    n, me, count = len(sizes), jax.process_index(), jax.process_count()
    names = (["model.safetensors"] if n == 1 else
             [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)])
    left = [sum(1 for s in shard_of.values() if s == i) for i in range(n)]
    pending: dict[int, dict[str, np.ndarray]] = {}
    written = []
    if me == 0:
        export_dir.prepare(path)
    _barrier(f"save_params staging {path}")
    staging = export_dir.staging_dir(path)
    try:
        for p, unit, keys, _ in plan:
            if all(shard_of[k] % count != me for k in keys) and (
                    params[p].is_fully_addressable or params[p].sharding.is_fully_replicated):
                for key in keys:
                    left[shard_of[key]] -= 1
                continue  # not this process's, and no collective to join
            t = tensors[p]
            value = _gather(params[p], unit, dtype)
            lead = t.lead - (unit is not None)
            parts = dataclasses.replace(t, keys=keys, lead=lead).to_hf(value)
            for key, part in zip(keys, parts, strict=True):
                shard = shard_of[key]
                left[shard] -= 1
                if shard % count == me:
                    pending.setdefault(shard, {})[key] = part
                if not left[shard] and shard in pending:
                    save_file(pending.pop(shard), staging / names[shard],
                              metadata=export_dir.MARK)
                    written.append(path / names[shard])
        _barrier(f"save_params {path}")
        if me == 0:
            if n > 1:
                index = {"metadata": {"total_size": sum(sizes)},
                         "weight_map": {k: names[s] for k, s in shard_of.items()}}
                (staging / INDEX_FILE).write_text(json.dumps(index, indent=2))
            (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
            if add_files is not None:
                add_files(staging)
            export_dir.commit(path)
    except BaseException:
        if count == 1:  # on several, the next export to path removes the staging directory
            export_dir.discard(path)
        raise
    _barrier(f"save_params done {path}")
    return written


def save_model(model: Transformer, path, *, dtype=None, max_shard_bytes: int = 5 * 2**30,
               metadata: dict | None = None, replace: bool = False) -> list[Path]:
    """Export ``model`` as a HF checkpoint directory transformers can load
    (``save_params`` of its parameters; every process calls it when they span several).

    Args:
      model: the ``Transformer``.
      path, dtype, max_shard_bytes, metadata, replace: see ``save_params``.

    Returns:
      The safetensors files this process wrote.

    Raises:
      CheckpointError, ValueError, FileExistsError: see ``save_params``.
    """
    params = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    return save_params({p: v[...] for p, v in params.items()}, model.cfg, path, dtype=dtype,
                       max_shard_bytes=max_shard_bytes, metadata=metadata, replace=replace)
