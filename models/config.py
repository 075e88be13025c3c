"""``ModelConfig``: the architecture and dtype policy of a Qwen3 / Qwen3-MoE, Qwen2 /
Qwen2.5 or Llama 3 decoder, and presets.

Field names follow the Hugging Face ``Qwen3Config`` / ``Qwen3MoeConfig`` ones, so a
``config.json`` maps onto them one to one (see ``models.hf``); the families differ by
three flags: ``qk_norm`` (Qwen3), ``qkv_bias`` (Qwen2) and ``rope_scaling`` (Llama 3).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from models.scan import REMAT_POLICIES
from models.sharding import DEFAULT_RULES, normalize_rules


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and dtype policy of a Qwen3 (dense), Qwen3-MoE, Qwen2 / Qwen2.5 or
    Llama 3 decoder.

    Architecture (Hugging Face names): ``vocab_size`` V, ``hidden_size`` H,
    ``intermediate_size`` (dense SwiGLU width), ``num_hidden_layers``,
    ``num_attention_heads`` N, ``num_key_value_heads`` K (GQA, ``N % K == 0``),
    ``head_dim`` D (even, for RoPE), ``rope_theta``, ``rms_norm_eps``,
    ``tie_word_embeddings``, ``max_position_embeddings`` (informational: nothing is
    precomputed up to it).

    Family flags: ``qk_norm`` (per-head RMSNorm of queries and keys before RoPE: Qwen3;
    False: Qwen2, Llama), ``qkv_bias`` (biases on the query, key and value projections,
    none on the output one: Qwen2 / Qwen2.5), ``rope_scaling`` (None: plain RoPE;
    ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    "original_max_position_embeddings"}``: Llama 3.1's frequency-dependent scaling, as
    ``transformers``' ``_compute_llama3_parameters``; stored as a sorted tuple of
    ``(name, value)`` pairs, hashable, read back by ``rope_parameters``).

    Mixture of experts (all ignored when ``num_experts == 0``, the dense Qwen3):
    ``num_experts`` E, ``num_experts_per_tok`` (top-k), ``moe_intermediate_size``,
    ``norm_topk_prob`` (renormalise the top-k router probabilities to sum to 1),
    ``decoder_sparse_step`` and ``mlp_only_layers`` (layer ``i`` is sparse iff
    ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``),
    ``router_aux_loss_coef`` (weight a trainer may give the load-balancing loss).

    Memory: ``remat`` recomputes each decoder layer in the backward pass
    (``jax.checkpoint`` around the layer), trading one more forward of the layers for
    activation memory; ``remat_policy`` names what each layer still saves:
    ``"nothing_saved"`` (only the layer inputs: activation memory no longer grows with
    depth), ``"offload"`` (the layer inputs, in pinned host memory: no activation memory
    on the device beyond one layer's recomputation, at the price of a host copy of each
    layer input each way), ``"dots_saved"`` (also the matmul outputs without batch
    dimensions), ``"full"`` (everything: the same as ``remat=False``). Decoding with a KV cache never
    rematerialises.

    Depth: ``scan_layers`` stacks the decoder layers' parameters on a leading ``[L]`` axis
    (logical axis ``"layers"``, parameter paths ``layers.<name>`` instead of
    ``layers.<i>.<name>``) and runs them with ``jax.lax.scan`` (``models.scan``), so the
    compiled program, and its compile time, do not grow with depth. It needs identical
    layers: an MoE config whose ``mlp_only_layers`` / ``decoder_sparse_step`` mix dense and
    sparse layers is rejected. Decoding with a KV cache loops over the layers.

    Attention: ``attention_impl`` is ``"auto"`` (by backend: splash on TPU, the Pallas GPU
    kernel on GPU, ``"xla_chunked"`` elsewhere, falling back to ``"xla_chunked"`` with a
    warning on logger ``"jaxhead"`` when a kernel cannot run the shapes) or one of
    ``"xla_chunked"``, ``"splash"``, ``"pallas_gpu"``, ``"dense"`` (the quadratic
    reference); see ``models.attention.api``.

    The op choices (``attention_impl``, ``expert_dispatch``) and the MoE dispatch settings
    (``expert_capacity_factor``, ``expert_capacity_overflow``, ``moe_token_chunk``) are
    checked against their ops where the model is built (``models.transformer.check_ops``,
    called by ``Transformer``), so that this module needs none of the ops.

    Expert parallelism (under a mesh with ``expert > 1``): ``expert_dispatch`` is
    ``"auto"`` (``jax.lax.ragged_all_to_all`` on TPU / GPU, the worst-case dense
    all-to-all blocks elsewhere: XLA:CPU has no ragged all-to-all), ``"ragged"`` (its CPU
    fallback is an emulation with dense memory, for tests) or ``"dense"``;
    ``expert_capacity_factor`` (ragged only) is None (receive buffers sized for the worst
    routing: dropless) or ``f > 0`` (``f`` times the balanced load per device; real
    (token, expert) pairs past it are dropped in GShard's priority order and counted in
    ``DecoderOutput.dropped_fraction``); ``expert_capacity_overflow`` says what a dropped
    pair does: ``"drop"`` (default: it adds 0, its token keeps its residual and its other
    experts, as in GShard / Switch / MaxText) or ``"nan"`` (strict: its token's MoE
    output is NaN, so the loss is NaN rather than different from the dropless model).
    Padding (segment id 0) is never dispatched and takes no capacity. See
    ``models.moe.api``.

    MoE memory: ``moe_token_chunk`` is None (a device's tokens go through the experts at
    once, in all-to-all rounds only as small as ``models.moe.api.MAX_DISPATCH_ROWS``
    needs) or ``n > 0``: the experts take at most ``n`` of a device's tokens at a time,
    one chunk after another (``jax.lax.map``), each chunk's dispatch, experts and combine
    rematerialised in the backward, so their buffers do not grow with the sequence (on
    one device and under a mesh). A token count that is no multiple of the chunk is
    padded up to one with padding tokens (not dispatched, no effect). Same outputs and
    gradients (the router and its statistics are not chunked), except that with
    ``expert_capacity_factor`` the capacity is per chunk, so drops may differ.

    Numerics: ``numerics`` is ``"default"`` (each op as fast as its implementation makes
    it; a token's results move by float rounding with the batch it is computed in) or
    ``"invariant"`` (``models.invariant``: every per-token op on row tiles of one shape,
    ``attention_impl`` ``"invariant"``, the head's log-probs tiled alike, so the sampler's
    log-probs of a completion equal the trainer's bit for bit, on one device or over the
    batch axes and ``context`` of a mesh; MoE layers route per row tile and run their
    experts in expert-major tiles of one shape, ``models.moe.invariant``; an explicit
    other ``attention_impl``, for MoE an explicit ``expert_dispatch`` or a capacity
    factor, and a ``tensor`` axis are refused by name). Checked where the model is built, with the other op choices.

    Head: ``final_logit_softcapping`` (Gemma 2 style ``c * tanh(z / c)`` on the logits,
    forwarded to jaxhead) or None.

    Placement: ``sharding_rules`` map the parameters' logical axis names to mesh axes
    (``models.sharding``; default ``DEFAULT_RULES``); the expert-parallel MoE reads them
    under a mesh, and a trainer places the parameters by the same rules. A hashable tuple
    of ``(logical name, mesh axis | tuple of axes | None)`` pairs (lists are converted).

    dtype policy: ``param_dtype`` (float32 or bfloat16) stores the parameters; ``dtype``
    (default bfloat16) is the compute dtype of matmuls and activations. RMSNorm, RoPE,
    the attention softmax and the router softmax always run in float32, and the head
    accumulates in float32. Both accept a dtype or its name and are stored as
    ``jnp.dtype``.

    Raises:
      ValueError: inconsistent sizes (heads not divisible, odd head_dim, top-k larger than
        the number of experts, non-positive sizes, an unknown dtype or remat policy,
        ``scan_layers`` over mixed dense / MoE layers, a ``rope_scaling`` of another type
        than ``"llama3"`` or missing one of its keys, ...).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    final_logit_softcapping: float | None = None
    qk_norm: bool = True
    qkv_bias: bool = False
    rope_scaling: tuple[tuple[str, str | float | int], ...] | None = None
    remat: bool = False
    remat_policy: str = "nothing_saved"
    scan_layers: bool = False
    attention_impl: str = "auto"
    expert_dispatch: str = "auto"
    expert_capacity_factor: float | None = None
    expert_capacity_overflow: str = "drop"
    moe_token_chunk: int | None = None
    numerics: str = "default"
    sharding_rules: tuple[tuple[str, str | tuple[str, ...] | None], ...] = DEFAULT_RULES
    dtype: jnp.dtype | str = "bfloat16"
    param_dtype: jnp.dtype | str = "float32"

    def __post_init__(self):
        set_ = object.__setattr__
        for name in ("dtype", "param_dtype"):
            value = jnp.dtype(getattr(self, name))
            if value not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
                raise ValueError(f"{name} must be float32 or bfloat16, got {value}")
            set_(self, name, value)
        set_(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        set_(self, "sharding_rules", normalize_rules(self.sharding_rules))
        set_(self, "rope_scaling", _rope_scaling(self.rope_scaling))
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "head_dim", "decoder_sparse_step")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        dense = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense and self.intermediate_size <= 0:
            raise ValueError(f"dense MLP layers {dense} need intermediate_size > 0")
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise ValueError("an MoE config needs moe_intermediate_size > 0")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"remat_policy must be one of {tuple(REMAT_POLICIES)}, got "
                             f"{self.remat_policy!r}")
        if self.scan_layers and self.is_moe and dense:
            raise ValueError(
                f"scan_layers needs identical layers, but layers {dense} are dense and the "
                f"others MoE (mlp_only_layers={self.mlp_only_layers}, decoder_sparse_step="
                f"{self.decoder_sparse_step}); set scan_layers=False"
            )
        cap = self.final_logit_softcapping
        if cap is not None and cap <= 0:
            raise ValueError(f"final_logit_softcapping must be > 0 or None, got {cap}")

    @property
    def rope_parameters(self) -> dict | None:
        """``rope_scaling`` as a dict (None without scaling)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    @property
    def is_moe(self) -> bool:
        """Whether any layer has a sparse MoE block (Qwen3-MoE)."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, layer: int) -> bool:
        """Whether layer ``layer`` (0-based) uses the sparse MoE block instead of the MLP."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    def replace(self, **changes) -> ModelConfig:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)


#: The keys of a ``"llama3"`` ``rope_scaling`` besides ``rope_type``.
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor",
                    "original_max_position_embeddings")


def _rope_scaling(value) -> tuple[tuple[str, str | float | int], ...] | None:
    """``ModelConfig.rope_scaling`` normalised: None, or sorted ``(name, value)`` pairs of
    a complete ``"llama3"`` scaling (factors as floats, the original length an int)."""
    if value is None:
        return None
    items = dict(value)
    if items.get("rope_type") != "llama3":
        raise ValueError(f"rope_scaling: only rope_type 'llama3' is supported, got "
                         f"{items.get('rope_type')!r}")
    missing = [k for k in LLAMA3_ROPE_KEYS if k not in items]
    extra = sorted(set(items) - {"rope_type", *LLAMA3_ROPE_KEYS})
    if missing or extra:
        raise ValueError(f"rope_scaling of type 'llama3' needs exactly the keys "
                         f"{LLAMA3_ROPE_KEYS}; missing {missing}, unknown {extra}")
    for key in LLAMA3_ROPE_KEYS:
        if not float(items[key]) > 0:
            raise ValueError(f"rope_scaling {key} must be > 0, got {items[key]!r}")
        items[key] = float(items[key])
    original = items["original_max_position_embeddings"]
    if original != int(original):
        raise ValueError(f"rope_scaling original_max_position_embeddings must be an integer, "
                         f"got {original}")
    items["original_max_position_embeddings"] = int(original)
    if items["high_freq_factor"] <= items["low_freq_factor"]:
        raise ValueError(f"rope_scaling high_freq_factor={items['high_freq_factor']} must be "
                         f"> low_freq_factor={items['low_freq_factor']}")
    return tuple(sorted(items.items()))


_QWEN3_COMMON = {"vocab_size": 151936, "head_dim": 128, "rope_theta": 1_000_000.0,
                     "rms_norm_eps": 1e-6, "max_position_embeddings": 40960}

PRESETS: dict[str, ModelConfig] = {
    "qwen3-0.6b": ModelConfig(
        **_QWEN3_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
        scan_layers=True,
    ),
    "qwen3-1.7b": ModelConfig(
        **_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, tie_word_embeddings=True,
        scan_layers=True,
    ),
    "qwen3-30b-a3b": ModelConfig(
        **_QWEN3_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, tie_word_embeddings=False,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
        norm_topk_prob=True, scan_layers=True,
    ),
    # Qwen2 architecture (q/k/v biases, no q/k norm): Qwen2.5-1.5B(-Instruct); its Math
    # variant differs by rope_theta=10_000 and max_position_embeddings=4096
    "qwen2.5-1.5b": ModelConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, head_dim=128, rope_theta=1_000_000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, max_position_embeddings=32768,
        qk_norm=False, qkv_bias=True, scan_layers=True,
    ),
    # Llama 3 architecture (llama3 RoPE scaling, no biases, no q/k norm): Llama-3.2-1B
    "llama-3.2-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, rope_theta=500_000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=131072,
        qk_norm=False, rope_scaling={"rope_type": "llama3", "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192},
        scan_layers=True,
    ),
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
        tie_word_embeddings=True, max_position_embeddings=512,
    ),
    "tiny-moe": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10_000.0,
        max_position_embeddings=512, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32,
    ),
}


def get_config(name: str, **overrides) -> ModelConfig:
    """The preset ``name`` (a key of ``PRESETS``) with ``overrides`` applied.

    Example: ``get_config("qwen3-0.6b", dtype="bfloat16", param_dtype="float32")``.

    Raises:
      KeyError: unknown preset (the known ones are listed).
      ValueError / TypeError: invalid overrides (see ``ModelConfig``).
    """
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
