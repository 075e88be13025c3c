"""Functional view of a ``models.Transformer``: a static ``ModelDef`` plus a flat dict of
parameter arrays, which optax updates and orbax checkpoints directly.

Parameter keys are the NNX paths joined with dots (``"layers.0.self_attn.q_proj"``,
``param_key``; with ``ModelConfig.scan_layers`` ``"layers.self_attn.q_proj"``, stacked
``[L, ...]``, so a per-layer prefix such as ``"layers.0"`` names nothing). Random initial
parameters come from ``train.rl.placement.Placement.init_params`` (``models.init_sharded``,
one ``jit``, directly in the mesh layout).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
from flax import nnx

import models

Params = dict[str, jax.Array]


def param_key(path) -> str:
    """The flat parameter key of an NNX path: its parts joined with dots."""
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
        state = nnx.from_flat_state([(p, params[param_key(p)]) for p in self.paths])
        return nnx.merge(self.graphdef, state)

    def abstract_model(self) -> models.Transformer:
        """The model with ``jax.ShapeDtypeStruct`` values (nothing allocated)."""
        return nnx.eval_shape(lambda: models.Transformer(self.cfg, rngs=nnx.Rngs(0)))

    def abstract_params(self) -> Params:
        """``jax.ShapeDtypeStruct`` of every parameter (for checkpoint restore)."""
        return {param_key(p): jax.ShapeDtypeStruct(v.shape, v.dtype)
                for p, v in nnx.to_flat_state(nnx.state(self.abstract_model(), nnx.Param))}

    def logical_axes(self) -> dict[str, tuple[str, ...]]:
        """Parameter key -> logical axis names (``models.logical_axes``), which
        ``cfg.sharding_rules`` map to mesh axes."""
        return {param_key(p): names
                for p, names in models.logical_axes(self.abstract_model()).items()}


def params_of(model: nnx.Module) -> Params:
    """The flat parameter dict of a built model."""
    return {param_key(p): v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def load_hf_config(path, *, dtype: str, param_dtype: str,
                   scan_layers: bool = False) -> models.ModelConfig:
    """The ``ModelConfig`` of a local Hugging Face checkpoint directory (``scan_layers``:
    the stacked layer layout, keys ``layers.<name>``; see ``models.ModelConfig``).

    Raises:
      FileNotFoundError: ``path`` is not a directory (named), or has no ``config.json``.
      models.CheckpointError: see ``models.hf.config_from_hf``.
    """
    if not Path(path).is_dir():
        raise FileNotFoundError(f"checkpoint directory {path!r} does not exist")
    return models.load_config(path, dtype=dtype, param_dtype=param_dtype,
                              scan_layers=scan_layers)


def load_hf(path, mdef: ModelDef, shardings: dict[str, jax.sharding.Sharding] | None = None
            ) -> Params:
    """The parameters of ``mdef`` from the checkpoint directory ``path``
    (``models.load_params``): each created in ``shardings[key]`` (e.g.
    ``train.rl.placement.Placement.params``), every process reading from the files only the
    slices its own devices hold; None: whole, on the default device.

    Raises:
      models.CheckpointError: a missing, extra or mis-shaped tensor (see
        ``models.load_params``).
    """
    by_path = None if shardings is None else {p: shardings[param_key(p)] for p in mdef.paths}
    return {param_key(p): v for p, v in models.load_params(path, mdef.cfg, by_path).items()}
