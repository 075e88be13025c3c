"""Running Tunix's own tests with the drop-in active (``conftest.py`` beside this file).

``register_test_models`` registers the head of Tunix's test model
(``tunix.tests.test_common.ToyTransformer``: ``lm_head = nnx.Linear(16, V)``, weight and
bias) with the adapter; the conftest calls it and wraps every test in
``jaxhead_tunix.drop_in()``. ``tests/jaxhead/test_tunix*.py`` use the same model.
"""

from __future__ import annotations

from jaxhead.integrations.tunix.heads import TunixHead, register_model


def toy_transformer_head(model) -> TunixHead:
    """``ToyTransformer``: ``logits = nnx.Linear(hidden)`` on the last layer's output,
    float32; ``kernel [16, V]``, ``bias [V]``."""
    linear = model.lm_head
    return TunixHead(module=linear, weight=linear.kernel[...], bias=linear.bias[...],
                     dtype=linear.kernel[...].dtype)


def register_test_models() -> None:
    """Register Tunix's ``ToyTransformer`` (imported from the installed Tunix)."""
    from tunix.tests import test_common

    register_model(test_common.ToyTransformer, toy_transformer_head)
