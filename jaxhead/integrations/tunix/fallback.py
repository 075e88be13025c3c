"""A model whose LM head the adapter cannot read, inside the drop-in: Tunix computes it.

A drop-in must not break a setup that works without it. Inside ``drop_in()`` (and
``log_probs()`` / ``policy_losses()``), a model the adapter cannot read (a class not
registered with ``register_model``, or a head with parameters its registration does not
read, such as LoRA on the head) gets Tunix's own computation for that call (full logits),
and one warning per model class names it and ``register_model``. ``strict=True`` raises
the adapter's error instead, and so does every call outside those blocks (e.g.
``compute_per_token_logps`` called directly).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

from jaxhead.integrations.tunix import heads

#: The blocks entered, innermost last: ``(strict, model classes warned about)``. A module
#: global, not a context variable: Tunix calls the hooks from its own threads too, and the
#: hooks themselves (module attributes, the loss registry) are process-wide.
_blocks: list[tuple[bool, set]] = []


@contextlib.contextmanager
def leave_to_tunix(strict: bool) -> Iterator[None]:
    """Inside the block, ``readable`` leaves unreadable models to Tunix (``strict``:
    raises). Nested blocks share the outermost one's warnings."""
    warned = _blocks[0][1] if _blocks else set()
    _blocks.append((strict, warned))
    try:
        yield
    finally:
        _blocks.pop()


def readable(model) -> bool:
    """Whether jaxhead computes ``model``'s head: True for a model the adapter reads;
    False, with one ``UserWarning`` per model class, for one it cannot read inside a
    non-strict block (the caller then runs Tunix's computation).

    Raises:
      TypeError / NotImplementedError: from ``heads.head_of``, in a strict block or
        outside every block.
    """
    try:
        heads.head_of(model)
    except (TypeError, NotImplementedError) as err:
        if not _blocks or _blocks[-1][0]:
            raise
        warned = _blocks[-1][1]
        if type(model) not in warned:
            warned.add(type(model))
            hint = "" if "register_model" in str(err) else " (register_model)"
            warnings.warn(
                f"{err}{hint}. So jaxhead's Tunix drop-in leaves this model to Tunix's own "
                "log-probs (its full [B, T, V] logits); drop_in(strict=True) raises instead.",
                UserWarning, stacklevel=2)
        return False
    return True
