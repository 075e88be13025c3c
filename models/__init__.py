"""Qwen3 / Qwen3-MoE, Qwen2 / Qwen2.5 and Llama 3 decoders in Flax NNX whose LM head is
jaxhead.

Public API:
  ModelConfig, PRESETS, get_config   architecture + dtype policy, named presets
  Transformer, DecoderOutput         the decoder (hidden states, KV cache, MoE aux loss and
                                     dropped fraction)
  check_ops                          a config's op choices against the ops (``Transformer``
                                     calls it; a trainer's config check may too)
  KVCache, init_cache                fixed-size cache for prefill + decode steps
                                     (the rollout engines that use it: models.generate)
  load_model, save_model, load_config, CheckpointError   HF safetensors import / export
  load_params                        HF parameters read per process in a mesh layout
  save_params                        HF export of parameters in any layout, each process
                                     writing its own shards
  check_export_destination           may an export write this directory (models.export_dir)
  logical_axes, logical_partition_specs                   parameter logical axis names
  DEFAULT_RULES, state_shardings, init_sharded, jit_sharded
                                     placement on a models.mesh mesh (models.sharding);
                                     the MoE runs expert-parallel under it
"""

from models.cache import KVCache, init_cache
from models.config import PRESETS, ModelConfig, get_config
from models.export_dir import check_destination as check_export_destination
from models.hf import (
    CheckpointError,
    load_config,
    load_model,
    load_params,
    save_model,
    save_params,
)
from models.mesh import BATCH_AXES, MeshConfig, make_mesh
from models.sharding import (
    DEFAULT_RULES,
    init_sharded,
    jit_sharded,
    logical_axes,
    logical_partition_specs,
    state_shardings,
)
from models.transformer import DecoderOutput, Transformer, check_ops

__all__ = [
    "BATCH_AXES",
    "DEFAULT_RULES",
    "PRESETS",
    "CheckpointError",
    "DecoderOutput",
    "KVCache",
    "MeshConfig",
    "ModelConfig",
    "Transformer",
    "check_export_destination",
    "check_ops",
    "get_config",
    "init_cache",
    "init_sharded",
    "jit_sharded",
    "load_config",
    "load_model",
    "load_params",
    "logical_axes",
    "logical_partition_specs",
    "make_mesh",
    "save_model",
    "save_params",
    "state_shardings",
]
