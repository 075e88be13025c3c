"""Functional view of a ``models.Transformer``: a static ``ModelDef`` plus a flat dict of
parameter arrays, which optax updates and orbax checkpoints directly.

Parameter keys are the NNX paths joined with dots (``"layers.0.self_attn.q_proj"``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

import models

Params = dict[str, jax.Array]


def _key(path) -> str:
    return ".".join(map(str, path))


@dataclasses.dataclass(frozen=True, eq=False)
class ModelDef:
    """The static part of a model: config, NNX graph definition, parameter paths.

    ``merge(params)`` rebuilds the ``Transformer`` (inside ``jit`` too).
    """

    cfg: models.ModelConfig
    graphdef: object
    paths: tuple[tuple, ...]

    @classmethod
    def of(cls, cfg: models.ModelConfig) -> ModelDef:
        abstract = nnx.eval_shape(lambda: models.Transformer(cfg, rngs=nnx.Rngs(0)))
        graphdef, params = nnx.split(abstract, nnx.Param)
        return cls(cfg, graphdef, tuple(p for p, _ in nnx.to_flat_state(params)))

    def merge(self, params: Params) -> models.Transformer:
        state = nnx.from_flat_state([(p, params[_key(p)]) for p in self.paths])
        return nnx.merge(self.graphdef, state)

    def abstract_params(self) -> Params:
        """``jax.ShapeDtypeStruct`` of every parameter (for checkpoint restore)."""
        model = nnx.eval_shape(lambda: models.Transformer(self.cfg, rngs=nnx.Rngs(0)))
        return {_key(p): jax.ShapeDtypeStruct(v.shape, v.dtype)
                for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def params_of(model: nnx.Module) -> Params:
    """The flat parameter dict of a built model."""
    return {_key(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def init_params(mdef: ModelDef, seed: int) -> Params:
    """Random initial parameters, initialised inside one ``jit`` (eager NNX init runs one
    dispatch per initialiser and is several times slower)."""

    @jax.jit
    def init():
        return params_of(models.Transformer(mdef.cfg, rngs=nnx.Rngs(seed)))

    return init()


def load_hf(path, *, dtype: str, param_dtype: str) -> tuple[ModelDef, Params]:
    """``(ModelDef, params)`` of a local Hugging Face checkpoint directory.

    Raises:
      FileNotFoundError: ``path`` is not a directory (named), or has no ``config.json``.
      models.CheckpointError: see ``models.load_model``.
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    model = models.load_model(path, dtype=dtype, param_dtype=param_dtype)
    return ModelDef.of(model.cfg), params_of(model)


def count_params(params: Params) -> int:
    """Total number of parameter elements."""
    return sum(int(v.size) for v in params.values())
