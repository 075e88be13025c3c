"""Where a Tunix model keeps its LM head, and how to get its final hidden states.

``register_model`` maps a model class to a ``model -> TunixHead`` function; Tunix's Qwen3
and Qwen2 (``tunix/models/qwen3/model.py``, ``tunix/models/qwen2/model.py``) are registered
here, tied and untied. ``head_of`` raises a ``TypeError`` naming any other class.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx
from tunix.models.qwen2 import model as _qwen2_model
from tunix.models.qwen3 import model as _qwen3_model


class TunixHead(NamedTuple):
    """The LM head of a Tunix model, as ``jaxhead.token_logprobs`` takes it.

    Attributes:
      weight: ``[H, V]`` head weight (a tied embedding's ``[V, H]`` table transposed).
      dtype: the dtype the model computes its logits in (``config.dtype`` for Qwen3):
        hidden states and weight are cast to it, as the model's own head does; jaxhead then
        accumulates the logits in float32 (Tunix's own head rounds them to ``dtype``).
      softcap: final-logit soft-cap ``c`` (``z = c * tanh(u / c)``, Gemma 2 style) or None.
    """

    weight: jax.Array
    dtype: Any
    softcap: float | None = None


_HEADS: dict[type, Callable[[nnx.Module], TunixHead]] = {}


def register_model(model_cls: type, head: Callable[[nnx.Module], TunixHead]) -> None:
    """Tell the adapter how to find the LM head of ``model_cls`` (and its subclasses).

    The model must also give its final hidden states (after the final norm): its
    ``__call__`` takes ``output_hidden_states=True`` and then sows them as
    ``nnx.Intermediate`` ``"all_hidden_states"``, as Tunix's Qwen3, Qwen2, Gemma and Gemma3
    do. Qwen3 and Qwen2 are registered on import (tied and untied heads); other classes
    raise ``TypeError`` naming the class until registered.

    Args:
      model_cls: a Tunix (Flax NNX) model class.
      head: ``model -> TunixHead``; called inside the traced loss, so it must read the
        weight from the model passed in (never a captured array).
    """
    _HEADS[model_cls] = head


def _qwen_head(model) -> TunixHead:
    """Qwen3 / Qwen2 (``tunix/models/qwen3/model.py``): ``logits = embedder.decode(x)`` =
    ``x @ input_embedding.T`` when ``config.use_tied_embedding``, else ``lm_head(x)`` =
    ``einsum('BTD,DV->BTV', x, lm_head.w)``, both in ``config.dtype``."""
    cfg = model.config
    module = model.embedder if cfg.use_tied_embedding else model.lm_head
    _no_lora(model, module)
    weight = module.input_embedding[...].T if cfg.use_tied_embedding else module.w[...]
    return TunixHead(weight, cfg.dtype)


register_model(_qwen3_model.Qwen3, _qwen_head)
register_model(_qwen2_model.Qwen2, _qwen_head)


def _no_lora(model, module) -> None:
    """A LoRA adapter on the head (qwix) adds a low-rank term the bare weight misses."""
    if jax.tree.leaves(nnx.state(module, nnx.LoRAParam)):
        raise NotImplementedError(
            f"{type(model).__name__}: the LM head carries LoRA parameters "
            f"({type(module).__name__}); jaxhead.integrations.tunix reads the bare head "
            "weight, so LoRA on the head is not supported (LoRA on the decoder layers is)"
        )


def model_name(model) -> str:
    """``"Qwen3 (tunix.models.qwen3.model.Qwen3)"``: how errors name a model."""
    cls = type(model)
    return f"{cls.__name__} ({cls.__module__}.{cls.__qualname__})"


def head_of(model) -> TunixHead:
    """The registered head of ``model`` (its class or the nearest registered base).

    Raises:
      TypeError: an unregistered class, named, saying whether it can give hidden states.
      NotImplementedError: LoRA parameters on a built-in model's head.
    """
    for cls in type(model).__mro__:
        if cls in _HEADS:
            return _HEADS[cls](model)
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


def final_hidden(model, input_tokens, model_kwargs) -> jax.Array:
    """``[B, T, H]`` final hidden states (after the final norm) of one forward pass."""
    model(input_tokens, output_hidden_states=True, **model_kwargs)
    sown = nnx.pop(model, nnx.Intermediate)
    if "all_hidden_states" not in sown:
        raise ValueError(
            f"{model_name(model)} did not sow 'all_hidden_states' with "
            "output_hidden_states=True; the adapter needs its final hidden states"
        )
    return sown["all_hidden_states"].get_value()[-1]
