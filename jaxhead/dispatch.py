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
* ``Entry``: one implementation of an op, in the one shape every op uses: its name, the
  platforms ``"auto"`` may pick it on, its ``check`` (can it run this call, and with
  which plan; ``KernelUnsupported`` when not), its ``probe`` (does its kernel lower,
  ``"auto"`` only) and its ``call``.
* ``Registry``: an op's entries in order of preference. ``Registry.resolve(impl,
  *query)`` turns ``"auto"`` or a name into the ``Choice`` (name, call, plan) that runs
  the call: ``"auto"`` takes the first entry for the target platform that its check
  and probe accept, logging on logger ``"jaxhead"`` (level WARNING) each one skipped,
  why, and the one used instead. Only ``KernelUnsupported`` and a failed lowering skip an
  entry: any other error raises.
* ``strict``: a block in which ``"auto"`` may not fall back (a skip raises instead).
* ``lowering_error``: the lowering probe a ``probe`` uses: lowers a function of abstract
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
    """One implementation of an op: every op declares its entries in this one shape.

    Attributes:
      name: what callers pass (``impl="..."``, a config field).
      call: the implementation the op runs with the chosen entry's plan; its signature
        is the op's (the same for every entry of one registry).
      platforms: the platforms ``"auto"`` may pick it on (None: any).
      check: ``check(*query) -> plan``: whether it can run the op's call described by
        ``query`` (the op decides what that holds: shapes, a config, the mesh's platform)
        and what ``call`` needs for it; raises ``KernelUnsupported`` when it cannot (any
        other exception is a failure, not a refusal: it propagates). None: it runs every
        call, with plan None.
      probe: ``probe(plan, *query) -> None | reason``, under ``"auto"`` only, after
        ``check``: a kernel's lowering probe (``lowering_error``), so that a kernel that
        would not lower is refused before the user's program is lowered, not inside it.
        None: not probed.
      auto: whether ``"auto"`` considers it at all (False: reference paths).
    """

    name: str
    call: T
    platforms: tuple[str, ...] | None = None
    check: Callable[..., Any] | None = None
    probe: Callable[..., str | None] | None = None
    auto: bool = True


@dataclasses.dataclass(frozen=True)
class Choice(Generic[T]):
    """The entry that runs a call: its ``name``, ``call`` and the ``plan`` its check made.
    ``choice(*args, **kwargs)`` is ``call(plan, *args, **kwargs)``."""

    name: str
    call: T
    plan: Any = None

    def __call__(self, *args, **kwargs):
        return self.call(self.plan, *args, **kwargs)


_strict: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxhead_strict", default=False)


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """In this block (calls traced in it), ``"auto"`` may not fall back: where the first
    implementation it would try for the platform cannot run a call, ``Registry.resolve``
    raises ``KernelUnsupported`` with the reason instead of logging it and using the next
    one. For a long run on a pod: a kernel that silently fell back to a slower path would
    cost hours; strict mode makes it an error at the first trace."""
    token = _strict.set(enabled)
    try:
        yield
    finally:
        _strict.reset(token)


def is_strict() -> bool:
    """Whether ``strict`` is in force here."""
    return _strict.get()


class Registry(Generic[T]):
    """The implementations of one op, in ``"auto"``'s order of preference.

    Args:
      op: the op's parameter name, for messages (e.g. ``"attention_impl"``).
      entries: its ``Entry``s; the last one ``"auto"`` may pick should run everywhere.

    Raises:
      ValueError: two entries with one name.
    """

    def __init__(self, op: str, entries: list[Entry[T]]):
        self.op = op
        self.entries = {e.name: e for e in entries}
        if len(self.entries) != len(entries):
            raise ValueError(f"{op}: entry names repeat: {[e.name for e in entries]}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def __getitem__(self, name: str) -> Entry[T]:
        return self.entries[name]

    def replace(self, entry: Entry[T]) -> Registry[T]:
        """A copy with ``entry`` in place of the entry of its name (tests swap one)."""
        self.check_name(entry.name)
        return Registry(self.op, [entry if e.name == entry.name else e
                                  for e in self.entries.values()])

    def check_name(self, impl: str) -> None:
        """Raise ``ValueError`` (naming ``impl`` and the choices) unless ``impl`` is
        ``"auto"`` or a registered name."""
        if impl != "auto" and impl not in self.entries:
            raise ValueError(f"{self.op} must be 'auto' or one of {self.names}, got {impl!r}")

    def candidates(self, platform: str) -> list[str]:
        """The names ``"auto"`` tries on ``platform``, in order."""
        return [e.name for e in self.entries.values()
                if e.auto and (e.platforms is None or platform in e.platforms)]

    def resolve(self, impl: str, *query, platform: str | None = None,
                first: str | None = None) -> Choice[T]:
        """The ``Choice`` that runs the call ``query`` describes.

        Args:
          impl: ``"auto"`` or a registered name.
          query: the op's description of the call, passed to each entry's ``check``
            and ``probe``.
          platform: the target platform (None: ``target_platform()``).
          first: under ``"auto"``, the name tried before the platform's candidates
            (e.g. the implementation a given config belongs to); the candidates follow.

        An explicit name is checked (not probed): its ``KernelUnsupported`` reaches the
        caller. ``"auto"`` tries ``first`` and the platform's candidates in order; one
        whose check raises ``KernelUnsupported`` or whose probe returns a reason is
        skipped, and once one passes each skipped one is logged with its reason and the
        name used (logger ``"jaxhead"``, WARNING), or, under ``strict``, the first refusal
        raises. Any other exception of a check or a probe propagates: a failing kernel is
        an error, never a silent fallback.

        Raises:
          ValueError: an unknown name (listing the choices).
          KernelUnsupported: an explicit name refused; under ``"auto"`` no candidate
            left, or (``strict``) any candidate skipped.
        """
        self.check_name(impl)
        if impl != "auto":
            return self._choose(self.entries[impl], query)
        platform = target_platform() if platform is None else platform
        order = self.candidates(platform)
        if first is not None:
            self.check_name(first)
            order = [first] + [n for n in order if n != first]
        skipped = []
        for name in order:
            entry = self.entries[name]
            try:
                choice = self._choose(entry, query)
                reason = None if entry.probe is None else entry.probe(choice.plan, *query)
            except KernelUnsupported as err:
                reason = str(err)
            else:
                if reason is not None:
                    reason = f"its kernels do not lower for this platform ({reason})"
            if reason is None:
                for refused, why in skipped:
                    logger.warning("%s='auto': %s cannot run this call (%s); using %r",
                                   self.op, refused, why, name)
                return choice
            if is_strict():
                raise KernelUnsupported(f"{self.op}='auto' under jaxhead.dispatch.strict: "
                                        f"{name} cannot run this call on {platform!r} "
                                        f"({reason})")
            skipped.append((name, reason))
        reasons = "; ".join(f"{n}: {r}" for n, r in skipped) or "none registered"
        raise KernelUnsupported(f"{self.op}='auto': no implementation can run this call on "
                                f"{platform!r} ({reasons})")

    @staticmethod
    def _choose(entry: Entry[T], query: tuple) -> Choice[T]:
        plan = None if entry.check is None else entry.check(*query)
        return Choice(entry.name, entry.call, plan)


def lowering_error(fn: Callable, *args, platform: str | None = None) -> str | None:
    """None when ``jax.jit(fn)`` of the abstract ``args`` (``jax.ShapeDtypeStruct``s)
    lowers for ``platform`` (None: the backend's; ``"gpu"``: CUDA), else the lowering's
    error as ``"Type: message"`` (whitespace collapsed, first 500 characters): the
    compiler refusing the kernel (Mosaic or Triton refusing an op, a block shape, a
    layout), which is what "unsupported here" means past the op's own checks. Lowering
    builds the Mosaic / Triton IR without compiling it: failures past lowering (e.g. VMEM)
    are not caught.

    Raises:
      Exception: whatever tracing ``fn`` raises (``KernelUnsupported`` from the kernel's
        own checks, or a bug in it): only the lowering's failures are answers.
    """
    platforms = None if platform is None else ({"gpu": "cuda"}.get(platform, platform),)
    traced = jax.jit(fn).trace(*args)
    try:
        traced.lower(lowering_platforms=platforms)
    except Exception as err:  # noqa: BLE001 - the compiler refused it: do not use this kernel
        return f"{type(err).__name__}: {' '.join(str(err).split())[:500]}"
    return None
