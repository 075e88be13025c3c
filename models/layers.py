"""Building blocks: parameters with logical axes, RMSNorm, RoPE, the SwiGLU MLP, embeddings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig


def param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype, *,
          in_axes: tuple[int, ...] = (0,), init=None) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` whose logical axis names are ``axes``.

    The names are metadata only (``out_sharding`` with ``eager_sharding=False``): no mesh
    is needed; ``models.sharding.logical_partition_specs`` reads them back.

    Args:
      rngs: key source (``rngs.params()``).
      shape: parameter shape.
      axes: one logical axis name per dimension.
      dtype: parameter dtype.
      in_axes: the input (fan-in) dimensions of a kernel; an ``"expert"`` axis is a batch
        axis of the initialiser, every other axis is an output axis.
      init: ``init(key, shape, dtype)``; default: truncated normal with variance
        ``1 / fan_in`` (LeCun).

    Raises:
      ValueError: ``len(axes) != len(shape)``.
    """
    if len(axes) != len(shape):
        raise ValueError(f"logical axes {axes} do not match shape {shape}")
    if init is None:
        batch = tuple(i for i, name in enumerate(axes) if name == "expert")
        out = tuple(i for i in range(len(shape)) if i not in in_axes and i not in batch)
        init = nnx.initializers.variance_scaling(
            1.0, "fan_in", "truncated_normal", in_axis=in_axes, out_axis=out, batch_axis=batch
        )
    return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis, computed in float32.

    ``y = x / sqrt(mean(x**2) + eps) * scale``; ``scale`` ``[dim]`` starts at ones.

    Args:
      dim: size of the normalised (last) axis.
      axis_name: logical axis name of ``scale`` (``"embed"`` or ``"head_dim"``).
      eps: added to the mean square.
      dtype: output dtype (the compute dtype).
      param_dtype: dtype of ``scale``.
      rngs: key source (unused by the ones initialiser).
    """

    def __init__(self, dim: int, axis_name: str, *, eps: float, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.eps, self.dtype = eps, dtype
        self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init=nnx.initializers.ones)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` ``[..., dim]`` any float dtype -> ``[..., dim]`` in ``dtype``."""
        x32 = x.astype(jnp.float32)
        inv = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
        return (x32 * inv * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None = None) -> jax.Array:
    """The ``D/2`` RoPE inverse frequencies ``theta**(-2i/D)``, float32, with Llama 3.1's
    scaling when ``scaling`` is a ``"llama3"`` dict (``ModelConfig.rope_parameters``):
    wavelengths ``2 pi / f`` above ``original_max_position_embeddings / low_freq_factor``
    are divided by ``factor``, those below ``original / high_freq_factor`` kept, and the
    ones between interpolated with ``s = (original / wavelength - low) / (high - low)``:
    ``(1 - s) f / factor + s f`` (Meta's Llama 3.1 reference code; transformers'
    ``_compute_llama3_parameters``)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_position_embeddings"]
    wavelength = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, theta: float,
               scaling: dict | None = None) -> jax.Array:
    """Rotary position embedding, "rotate half" layout (as Qwen / Llama checkpoints).

    Dimension pairs ``(i, i + D/2)`` rotate by ``positions * f_i``, ``f`` the inverse
    frequencies of ``rope_frequencies(D, theta, scaling)``; angles, sin and cos are
    computed in float32.

    Args:
      x: ``[B, T, heads, D]``, D even.
      positions: int ``[B, T]`` position of each token within its own sequence.
      theta: RoPE base (``rope_theta`` of the checkpoint).
      scaling: None, or the ``"llama3"`` scaling dict (``ModelConfig.rope_parameters``).

    Returns:
      ``[B, T, heads, D]`` in the dtype of ``x``.
    """
    inv_freq = rope_frequencies(x.shape[-1], theta, scaling)
    angles = positions.astype(jnp.float32)[..., None, None] * inv_freq
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(x @ gate) * (x @ up))``.

    Parameters: ``gate_proj``, ``up_proj`` ``[H, I]`` (axes ``embed, mlp``) and
    ``down_proj`` ``[I, H]`` (axes ``mlp, embed``).

    Args:
      hidden_size: H. intermediate_size: I.
      dtype: compute dtype. param_dtype: parameter dtype. rngs: initialiser keys.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, dtype, param_dtype,
                 rngs: nnx.Rngs):
        self.dtype = dtype
        h, i = hidden_size, intermediate_size
        self.gate_proj = param(rngs, (h, i), ("embed", "mlp"), param_dtype)
        self.up_proj = param(rngs, (h, i), ("embed", "mlp"), param_dtype)
        self.down_proj = param(rngs, (i, h), ("mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x`` ``[..., H]`` -> ``[..., H]`` in the compute dtype."""
        x = x.astype(self.dtype)
        gate = x @ self.gate_proj[...].astype(self.dtype)
        up = x @ self.up_proj[...].astype(self.dtype)
        return (jax.nn.silu(gate) * up) @ self.down_proj[...].astype(self.dtype)


def embedding(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Embed:
    """The token embedding ``[V, H]`` (axes ``vocab, embed``), an ``nnx.Embed`` so that
    ``jaxhead.LMHead`` can tie to it. It looks up in ``cfg.param_dtype`` and returns that
    dtype; the caller casts the rows to the compute dtype (``Transformer``). So the
    lookup's backward, a scatter-add of one cotangent row per position into the table,
    sums in the parameter dtype: an id at most positions of a batch (a chat template's
    pieces, the stop token) gets its full gradient (in bfloat16 a sum stops growing once
    it is 256 times its terms)."""
    return nnx.Embed(
        cfg.vocab_size, cfg.hidden_size, dtype=cfg.param_dtype, param_dtype=cfg.param_dtype,
        embedding_init=nnx.initializers.normal(1.0 / math.sqrt(cfg.hidden_size)),
        embedding_metadata={"out_sharding": ("vocab", "embed"), "eager_sharding": False},
        rngs=rngs,
    )
