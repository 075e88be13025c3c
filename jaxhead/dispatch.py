"""The one dispatch mechanism of jaxhead and of the models built on it: which
implementation of an op (the LM head, attention, the MoE's expert dispatch) runs a call.

* ``KernelUnsupported``: raised when an implementation cannot run a call (the message says
  why). Under ``"auto"`` it means "try the next one"; under an explicit name it reaches
  the caller.
* ``target_platform``: the platform the trace compiles for: ``compile_for``'s inside that
  block, else the devices of ``mesh`` (or of the mesh in context: ``jax.set_mesh``,
  ``jax.shard_map``'s abstract mesh), else ``jax.default_backend()``; ``"gpu"`` for CUDA
  and ROCm. A CPU machine under the mesh of a TPU topology's devices plans what a TPU
  would.
* ``Registry``: an op's implementations in order of preference, each with the platforms
  it runs on (None: any) and whether ``"auto"`` may pick it. ``Registry.resolve`` turns
  ``"auto"`` or a name into a name and the result of the caller's ``check``: ``"auto"``
  takes the first implementation for the target platform whose ``check`` passes (neither
  raises ``KernelUnsupported`` nor returns ``Unlowered``), logging on logger ``"jaxhead"``
  (level WARNING) each one skipped, why, and the one used instead.
* ``lowering_error``: the lowering probe a ``check`` uses: lowers a function of abstract
  inputs for the target platform and returns the error, so that a kernel that would not
  lower is refused before the user's program is lowered, not inside it.

jaxhead imports no models; ``models`` registers its own ops here.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import jax

logger = logging.getLogger("jaxhead")
T = TypeVar("T")


class KernelUnsupported(ValueError):
    """An implementation cannot run this call; the message says why (``impl="auto"`` then
    uses the next implementation and logs it)."""


_compile_for: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "jaxhead_compile_for", default=None)


@contextlib.contextmanager
def compile_for(platform: str) -> Iterator[None]:
    """Plans made in this block are for ``platform`` (``"tpu"`` or ``"gpu"``) whatever the
    backend: for lowering without the devices, e.g. ``jax.jit(f).trace(...).lower(
    lowering_platforms=("cuda",))`` on a CPU machine (the Triton kernels lower there)."""
    token = _compile_for.set(platform)
    try:
        yield
    finally:
        _compile_for.reset(token)


def target_platform(mesh=None) -> str:
    """The platform the current trace compiles for: ``"tpu"``, ``"gpu"``, ``"cpu"``, ...

    Args:
      mesh: a ``jax.sharding.Mesh`` / ``AbstractMesh`` the call runs on; None: the
        abstract mesh in context. Its devices decide; a mesh without devices (or none)
        leaves it to ``jax.default_backend()``. Inside ``compile_for(p)``: ``p``.
    """
    if _compile_for.get() is not None:
        return _compile_for.get()
    abstract = jax.sharding.get_abstract_mesh() if mesh is None else getattr(
        mesh, "abstract_mesh", mesh)
    device = getattr(abstract, "abstract_device", None)
    platform = jax.default_backend() if device is None else device.platform
    return "gpu" if platform in ("cuda", "rocm") else platform


@dataclasses.dataclass(frozen=True)
class Entry(Generic[T]):
    """One implementation of an op.

    Attributes:
      name: what callers pass (``impl="..."``).
      value: the implementation (a function, an object: the op decides).
      platforms: the platforms ``"auto"`` may pick it on (None: any).
      auto: whether ``"auto"`` considers it at all (False: reference paths).
    """

    name: str
    value: T
    platforms: tuple[str, ...] | None = None
    auto: bool = True


class Registry(Generic[T]):
    """The implementations of one op, in ``"auto"``'s order of preference.

    Args:
      op: the op's parameter name, for messages (e.g. ``"attention_impl"``).
      entries: its ``Entry``s; the last one ``"auto"`` may pick should run everywhere.
    """

    def __init__(self, op: str, entries: list[Entry[T]]):
        self.op = op
        self.entries = {e.name: e for e in entries}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def __getitem__(self, name: str) -> T:
        return self.entries[name].value

    def check_name(self, impl: str) -> None:
        """Raise ``ValueError`` (naming ``impl`` and the choices) unless ``impl`` is
        ``"auto"`` or a registered name."""
        if impl != "auto" and impl not in self.entries:
            raise ValueError(f"{self.op} must be 'auto' or one of {self.names}, got {impl!r}")

    def candidates(self, platform: str) -> list[str]:
        """The names ``"auto"`` tries on ``platform``, in order."""
        return [e.name for e in self.entries.values()
                if e.auto and (e.platforms is None or platform in e.platforms)]

    def resolve(self, impl: str, check: Callable[[str], Any] | None = None,
                platform: str | None = None, order: tuple[str, ...] | None = None
                ) -> tuple[str, Any]:
        """``(name, check(name))`` of the implementation that runs the call.

        Args:
          impl: ``"auto"`` or a registered name.
          check: called with a name; returns whatever the op needs (e.g. a plan) or
            raises ``KernelUnsupported``; it may return ``Unlowered(reason)`` to refuse
            the name under ``"auto"`` (a failed lowering probe). None: every name passes.
          platform: the target platform (None: ``target_platform()``).
          order: the names ``"auto"`` tries (None: ``candidates(platform)``).

        Under an explicit name ``check``'s ``KernelUnsupported`` propagates. Under
        ``"auto"`` a refused candidate is skipped; once one passes, each skipped one is
        logged with its reason and the name used.

        Raises:
          ValueError: an unknown name (listing the choices).
          KernelUnsupported: explicit name refused; or no candidate left under "auto".
        """
        self.check_name(impl)
        check = check or (lambda name: None)
        if impl != "auto":
            return impl, check(impl)
        platform = target_platform() if platform is None else platform
        skipped = []
        for name in self.candidates(platform) if order is None else order:
            try:
                result = check(name)
            except KernelUnsupported as err:
                skipped.append((name, str(err)))
                continue
            if isinstance(result, Unlowered):
                skipped.append((name, (f"its kernels do not lower for this platform "
                                       f"({result.reason})")))
                continue
            for refused, reason in skipped:
                logger.warning("%s='auto': %s cannot run this call (%s); using %r",
                               self.op, refused, reason, name)
            return name, result
        reasons = "; ".join(f"{n}: {r}" for n, r in skipped) or "none registered"
        raise KernelUnsupported(f"{self.op}='auto': no implementation can run this call on "
                                f"{platform!r} ({reasons})")


@dataclasses.dataclass(frozen=True)
class Unlowered:
    """A ``check``'s answer that its implementation's kernels do not lower (``reason``)."""

    reason: str


def lowering_error(fn: Callable, *args, platform: str | None = None) -> str | None:
    """None when ``jax.jit(fn)`` of the abstract ``args`` (``jax.ShapeDtypeStruct``s)
    lowers for ``platform`` (None: the backend's; ``"gpu"``: CUDA), else the error as ``"Type: message"``
    (whitespace collapsed, first 500 characters). Lowering builds the Mosaic / Triton IR
    without compiling it: failures past lowering (e.g. VMEM) are not caught."""
    platforms = None if platform is None else ({"gpu": "cuda"}.get(platform, platform),)
    try:
        jax.jit(fn).trace(*args).lower(lowering_platforms=platforms)
    except Exception as err:  # noqa: BLE001 - any failure means: do not use this kernel
        return f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"
    return None
