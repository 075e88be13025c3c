"""Where the Pallas kernels run: on their accelerator, or interpreted on CPU.

The kernels of ``impl="pallas_tpu"`` and ``impl="pallas_triton"`` compile for a TPU or a
GPU. For tests and CPU dry runs they can run in Pallas interpret mode instead, selected
without any new argument on the public API:

* the environment variable ``JAXHEAD_PALLAS_INTERPRET`` (read when a kernel config is made,
  i.e. at trace time), or
* the context manager ``jaxhead.pallas_interpret(mode)``, which takes precedence over the
  variable.

Modes: ``None`` (unset, ``""`` or ``"0"``: compile for the device), ``"interpret"`` (``"1"``:
TPU kernels run in ``pltpu.InterpretParams()``, Triton kernels with ``interpret=True``) and
``"races"`` (TPU kernels run in the TPU interpreter with two simulated cores sharing the
"parallel" grid axis and its race detector on; Triton kernels as ``"interpret"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator

import jax

from jaxhead._src.head.base import KernelUnsupported

ENV_VAR = "JAXHEAD_PALLAS_INTERPRET"
MODES = (None, "interpret", "races")
_ENV_VALUES = {"": None, "0": None, "1": "interpret", "interpret": "interpret", "races": "races"}
_override: contextvars.ContextVar[tuple[str | None] | None] = contextvars.ContextVar(
    "jaxhead_pallas_interpret", default=None
)


def interpret_mode() -> str | None:
    """The current mode: the innermost ``interpret(...)`` context, else the env variable.

    Raises:
      ValueError: an unknown value of ``JAXHEAD_PALLAS_INTERPRET`` (the valid ones named).
    """
    override = _override.get()
    if override is not None:
        return override[0]
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw not in _ENV_VALUES:
        raise ValueError(f"{ENV_VAR} must be one of {sorted(_ENV_VALUES)}, got {raw!r}")
    return _ENV_VALUES[raw]


@contextlib.contextmanager
def interpret(mode: str | None = "interpret") -> Iterator[None]:
    """Run the kernels traced inside this block in ``mode`` (one of ``MODES``).

    Raises:
      ValueError: an unknown mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    token = _override.set((mode,))
    try:
        yield
    finally:
        _override.reset(token)


def check_platform(mode: str | None, platform: str, kernel: str) -> None:
    """Raise ``KernelUnsupported`` unless ``kernel`` can run here: interpreted, or on a
    default backend equal to ``platform`` (``"tpu"`` or ``"gpu"``)."""
    backend = jax.default_backend()
    if mode is None and backend != platform:
        raise KernelUnsupported(
            f"{kernel} needs a {platform} backend, the default backend is {backend!r} "
            f"(set {ENV_VAR}=1 to run it in Pallas interpret mode)"
        )
