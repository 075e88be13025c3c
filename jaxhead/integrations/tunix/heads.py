"""Where a Tunix model keeps its LM head, and how to get its final hidden states.

``register_model`` maps a model class to a ``model -> TunixHead`` function; Tunix's Qwen3
and Qwen2 (``tunix/models/qwen3/model.py``, ``tunix/models/qwen2/model.py``) are registered
here, tied and untied. ``head_of`` raises a ``TypeError`` naming any other class, and a
``NotImplementedError`` for a head module with parameters the registration does not read
(a LoRA adapter, a bias not passed as ``TunixHead.bias``): they would get no gradient.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tunix.models.qwen2 import model as _qwen2_model
from tunix.models.qwen3 import model as _qwen3_model


@dataclasses.dataclass(frozen=True, kw_only=True)
class TunixHead:
    """The LM head of a Tunix model: ``logits = hidden @ weight (+ bias)``, soft-capped.

    Attributes:
      module: the ``nnx.Module`` that computes the logits (``model.lm_head``, or the tied
        ``model.embedder``). Every ``nnx.Param`` in it (LoRA parameters included) must be
        ``weight`` or ``bias``: ``head_of`` refuses a head with others, which the adapter
        would leave without a gradient.
      weight: the head weight in ``weight_layout``: ``[H, V]``, or a tied embedding's
        ``[V, H]`` table as it is (no transposed copy; its gradient arrives ``[V, H]``).
      dtype: the dtype the model computes its logits in (``config.dtype`` for Qwen3):
        hidden states, weight and bias are cast to it, as the model's own head does;
        jaxhead then accumulates the logits in float32 (Tunix's own head rounds them to
        ``dtype``).
      bias: optional ``[V]`` bias added to the logits (``nnx.Linear(use_bias=True)``).
      softcap: final-logit soft-cap ``c`` (``z = c * tanh(u / c)``, Gemma 2 style) or None.
      weight_layout: ``"hv"`` (``weight [H, V]``) or ``"vh"`` (``weight [V, H]``), passed
        to ``jaxhead.token_logprobs`` / ``jaxhead.sample``.
    """

    module: nnx.Module
    weight: jax.Array
    dtype: Any
    bias: jax.Array | None = None
    softcap: float | None = None
    weight_layout: str = "hv"

    def operands(self, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(hidden', weight')`` in ``dtype`` with ``hidden' @ weight' = hidden @ weight +
        bias``, what ``jaxhead.token_logprobs`` / ``jaxhead.sample`` take.

        A bias is folded in exactly: ``hidden'`` is ``hidden [..., H]`` with a column of
        ones appended, ``weight'`` is ``weight`` with the bias appended at hidden index
        ``H`` (a row of ``[H, V]``, a column of ``[V, H]``), so every implementation
        (kernels, sharded, sampler) adds it inside its own float32 accumulation and the bias
        gradient is the weight gradient's hidden index ``H`` (``sum_t dL/dlogit_t``). The
        price: a copy of the weight with one more hidden entry, and a hidden size of
        ``H + 1``. Without a bias the inputs are only cast.
        """
        hidden, weight = hidden.astype(self.dtype), self.weight.astype(self.dtype)
        if self.bias is None:
            return hidden, weight
        ones = jnp.ones(hidden.shape[:-1] + (1,), self.dtype)
        bias = self.bias.astype(self.dtype)
        bias = bias[None, :] if self.weight_layout == "hv" else bias[:, None]
        return (jnp.concatenate([hidden, ones], axis=-1),
                jnp.concatenate([weight, bias], axis=0 if self.weight_layout == "hv" else 1))


_HEADS: dict[type, Callable[[nnx.Module], TunixHead]] = {}


def register_model(model_cls: type, head: Callable[[nnx.Module], TunixHead]) -> None:
    """Tell the adapter how to find the LM head of ``model_cls`` (and its subclasses).

    The model must also give its final hidden states (after the final norm): its
    ``__call__`` takes ``output_hidden_states=True`` and then sows them as
    ``nnx.Intermediate`` ``"all_hidden_states"`` (the last entry is read), as Tunix's
    Qwen3, Qwen2, Gemma and Gemma3 do. Qwen3 and Qwen2 are registered on import (tied and
    untied heads); other classes raise ``TypeError`` naming the class until registered.

    Example (a head ``self.lm_head = nnx.Linear(H, V)``, weight and bias)::

        register_model(MyModel, lambda m: TunixHead(
            module=m.lm_head, weight=m.lm_head.kernel[...], bias=m.lm_head.bias[...],
            dtype=jnp.float32))

    Args:
      model_cls: a Tunix (Flax NNX) model class.
      head: ``model -> TunixHead``; called inside the traced loss, so it must read the
        weight from the model passed in (never a captured array).
    """
    _HEADS[model_cls] = head


def _qwen_head(model) -> TunixHead:
    """Qwen3 / Qwen2 (``tunix/models/qwen3/model.py``): ``logits = embedder.decode(x)`` =
    ``x @ input_embedding.T`` when ``config.use_tied_embedding`` (the ``[V, H]`` table is
    used as it is: ``weight_layout="vh"``), else ``lm_head(x)`` =
    ``einsum('BTD,DV->BTV', x, lm_head.w)``, both in ``config.dtype``."""
    cfg = model.config
    if cfg.use_tied_embedding:
        return TunixHead(module=model.embedder, weight=model.embedder.input_embedding[...],
                         dtype=cfg.dtype, weight_layout="vh")
    return TunixHead(module=model.lm_head, weight=model.lm_head.w[...], dtype=cfg.dtype)


register_model(_qwen3_model.Qwen3, _qwen_head)
register_model(_qwen2_model.Qwen2, _qwen_head)


def model_name(model) -> str:
    """``"Qwen3 (tunix.models.qwen3.model.Qwen3)"``: how errors name a model."""
    cls = type(model)
    return f"{cls.__name__} ({cls.__module__}.{cls.__qualname__})"


def _check_params(model, head: TunixHead) -> None:
    """Every ``nnx.Param`` of the head module is the registered weight or bias."""
    params = [(".".join(map(str, path)), v) for path, v in nnx.to_flat_state(
        nnx.state(head.module, nnx.Param))]
    read = 1 + (head.bias is not None)
    if len(params) == read:
        return
    found = ", ".join(f"{name} ({type(v).__name__} {list(v.get_value().shape)})"
                      for name, v in params)
    raise NotImplementedError(
        f"{model_name(model)}: its LM head {type(head.module).__name__} has parameters "
        f"{found} but the registration reads {read} (the weight"
        f"{' and the bias' if read == 2 else ''}); the others would get no gradient. A "
        "bias is supported (TunixHead.bias); LoRA on the head is not (LoRA on the decoder "
        "layers is)"
    )


def registered(model) -> bool:
    """Whether ``model``'s class (or a base) is registered (``register_model``)."""
    return any(cls in _HEADS for cls in type(model).__mro__)


def head_of(model) -> TunixHead:
    """The registered head of ``model`` (its class or the nearest registered base).

    Raises:
      TypeError: an unregistered class, named, saying whether it can give hidden states.
      NotImplementedError: the head module has parameters the registration does not read
        (LoRA on the head; a bias not passed as ``TunixHead.bias``).
    """
    for cls in type(model).__mro__:
        if cls in _HEADS:
            head = _HEADS[cls](model)
            _check_params(model, head)
            return head
    try:
        gives_hidden = "output_hidden_states" in inspect.signature(model.__call__).parameters
    except (TypeError, ValueError):
        gives_hidden = False
    reason = (
        "its LM head weight is unknown to the adapter"
        if gives_hidden
        else "its __call__ has no output_hidden_states, so it cannot give its final hidden "
        "states"
    )
    supported = ", ".join(sorted(c.__name__ for c in _HEADS))
    raise TypeError(
        f"jaxhead.integrations.tunix cannot compute log-probs of a {model_name(model)}: "
        f"{reason}. Supported: {supported}; a model that sows its final hidden states "
        "(output_hidden_states=True -> nnx.Intermediate 'all_hidden_states') can be added "
        "with register_model(cls, head)"
    )


def accepts_segment_ids(model) -> bool:
    """Tunix's own test (``common.compute_per_token_logps``) for passing ``segment_ids``."""
    try:
        params = inspect.signature(model.__call__).parameters.values()
    except Exception:  # noqa: BLE001 - mirrors Tunix, which treats any failure as "no"
        return False
    return any(p.name == "segment_ids" or p.kind == inspect.Parameter.VAR_KEYWORD
               for p in params)


def final_hidden(model, input_tokens, model_kwargs) -> tuple[jax.Array, Any]:
    """``([B, T, H] final hidden states (after the final norm), the model's other
    output)`` of one forward pass (``model(...)`` returns ``(logits, cache)``; the cache
    is that other output, the logits are dropped and removed by the compiler).

    The hidden states are taken with ``nnx.capture(model, nnx.Intermediate)``: what the
    model sows lands in the returned state, never on the module.
    """
    (_, other), sown = nnx.capture(model, nnx.Intermediate)(
        input_tokens, output_hidden_states=True, **model_kwargs)
    if "all_hidden_states" not in sown:
        raise ValueError(
            f"{model_name(model)} did not sow 'all_hidden_states' with "
            "output_hidden_states=True; the adapter needs its final hidden states"
        )
    return sown["all_hidden_states"].get_value()[-1], other
