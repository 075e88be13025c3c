"""What a config key may hold, declared beside its default (``train/run/schema.py``), and the
one pass that checks a whole config before a run does any work (``train.config.cli``).

A key of the schema is ``Key(default, domain, resume=...)``:

* ``domain`` tells the values the key accepts (``integer(1)``, ``number(0, 1)``,
  ``one_of("a", "b")``, ...), in words for the error message and as a test;
* ``resume`` tells what a resumed run may do with it (``train.run.resume``): ``SAME`` (the
  default: a value that changes the results must stay), ``EXTENDS`` (it may grow: more
  steps), or ``FREE`` (how the run is carried out, not what it computes: checkpoint and
  log intervals, the mesh, the processes).

Keys that constrain each other (e.g. at most one mesh axis of size -1) are checked by the
relations the schema lists beside its keys.

Each rule is stated once: a domain or a relation that a module of ``train`` enforces on its
own arguments lives in that module (or here, for the common ones such as ``COUNT``), and
the schema imports it. The module raises through ``Domain.require`` / ``enforce``, so its
error and the config check's line are one text (``tests/train/test_layout.py`` finds a
rule stated twice).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

from ml_collections import ConfigDict

SAME, EXTENDS, FREE = "same", "extends", "free"


@dataclasses.dataclass(frozen=True)
class Domain:
    """The values a key accepts: ``text`` says which (it follows "must be"), ``ok`` tests a
    value (it may raise ``ValueError`` with a more precise reason)."""

    text: str
    ok: Callable[[Any], bool]

    def error(self, value) -> str | None:
        """None if ``value`` is in the domain, else why not (``ok``'s own reason when it
        raises one)."""
        try:
            if self.ok(value):
                return None
        except (TypeError, ValueError) as err:
            return str(err)
        return f"must be {self.text}"

    def require(self, key: str, value):
        """``value`` if it is in the domain.

        Raises:
          ValueError: ``"{key} = {value!r}: {reason}"``, the line ``check`` gives for it.
        """
        why = self.error(value)
        if why:
            raise ValueError(f"{key} = {value!r}: {why}")
        return value


@dataclasses.dataclass(frozen=True)
class Key:
    """A leaf of the config schema: its default, its domain and what a resumed run may do
    with it (``SAME``, ``EXTENDS`` or ``FREE``)."""

    default: Any
    domain: Domain
    resume: str = SAME


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _bounds(lo, hi, lo_open: bool, hi_open: bool) -> tuple[str, Callable[[Any], bool]]:
    if lo is not None and hi is not None:
        text = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    elif lo is not None:
        text = f"{'>' if lo_open else '>='} {lo:g}"
    elif hi is not None:
        text = f"{'<' if hi_open else '<='} {hi:g}"
    else:
        text = ""

    def inside(v) -> bool:
        above = lo is None or (v > lo if lo_open else v >= lo)
        below = hi is None or (v < hi if hi_open else v <= hi)
        return above and below

    return text, inside


def integer(lo: int | None = None, hi: int | None = None, note: str = "") -> Domain:
    """An int (not a bool) in ``[lo, hi]``."""
    text, inside = _bounds(lo, hi, False, False)
    return Domain(f"an integer {text}".strip() + note, lambda v: _is_int(v) and inside(v))


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, note: str = "") -> Domain:
    """A finite int or float between ``lo`` and ``hi`` (each bound closed unless open)."""
    text, inside = _bounds(lo, hi, lo_open, hi_open)
    return Domain(f"a number {text}".strip() + note, lambda v: _is_number(v) and inside(v))


def one_of(*choices: str) -> Domain:
    """One of the strings ``choices``."""
    return Domain("one of " + ", ".join(map(repr, choices)), lambda v: v in choices)


def boolean() -> Domain:
    return Domain("True or False", lambda v: isinstance(v, bool))


def string(nonempty: bool = False, note: str = "") -> Domain:
    return Domain(("a non-empty string" if nonempty else "a string") + note,
                  lambda v: isinstance(v, str) and (bool(v) or not nonempty))


def names(valid: Callable[[], list[str]] | None = None, *, nonempty: bool = False,
          note: str = "") -> Domain:
    """A tuple of non-empty strings (``valid()``: the names allowed; called when checked)."""

    def ok(v) -> bool:
        if isinstance(v, str) or not isinstance(v, tuple | list):
            return False
        if not all(isinstance(n, str) and n for n in v) or (nonempty and not v):
            return False
        if valid is not None:
            allowed = valid()
            unknown = [n for n in v if n not in allowed]
            if unknown:
                raise ValueError(f"unknown name(s) {', '.join(map(repr, unknown))}; valid "
                                 "names: " + ", ".join(allowed))
        return True

    return Domain(("a non-empty tuple of names" if nonempty else "a tuple of names") + note, ok)


def pairs(first: Callable[[Any], bool], second: Callable[[Any], bool], text: str) -> Domain:
    """A tuple of 2-tuples whose items pass ``first`` and ``second``."""

    def ok(v) -> bool:
        if isinstance(v, str) or not isinstance(v, tuple | list):
            return False
        return all(not isinstance(p, str) and isinstance(p, tuple | list) and len(p) == 2
                   and first(p[0]) and second(p[1]) for p in v)

    return Domain(text, ok)


def mapping(ok: Callable[[Mapping], bool], text: str) -> Domain:
    """A dict (a config section of free keys) that passes ``ok``."""
    return Domain(text, lambda v: isinstance(v, Mapping) and ok(v))


#: Common domains: a count (of updates, batches, rows, ...), any finite number, a
#: positive and a non-negative one, a fraction in [0, 1] and one in [0, 1).
COUNT = integer(1)
NUMBER = number()
POSITIVE = number(0, lo_open=True)
NONNEGATIVE = number(0)
FRACTION = number(0, 1)
FRACTION_BELOW_1 = number(0, 1, hi_open=True)

Schema = dict  # name -> Key | Schema


def defaults(schema: Schema) -> dict:
    """The nested dict of the schema's defaults (``ConfigDict(defaults(schema))``).

    Raises:
      TypeError: an entry that is neither a ``Key`` nor a section (a key declared
        without its domain).
    """
    out = {}
    for name, entry in schema.items():
        if isinstance(entry, Key):
            out[name] = entry.default
        elif isinstance(entry, dict):
            out[name] = defaults(entry)
        else:
            raise TypeError(f"config key {name!r}: declare it as Key(default, domain), "
                            f"got {entry!r}")
    return out


def keys(schema: Schema, prefix: str = "") -> dict[str, Key]:
    """Every leaf of the schema by its dotted name (``"train.optim.lr"``)."""
    out = {}
    for name, entry in schema.items():
        if isinstance(entry, Key):
            out[prefix + name] = entry
        else:
            out.update(keys(entry, f"{prefix}{name}."))
    return out


def plain(value):
    """A config value as plain Python data (sections as dicts)."""
    return value.to_dict() if isinstance(value, ConfigDict) else value


def value_at(cfg: ConfigDict, key: str):
    """The value of the dotted ``key`` in ``cfg`` (sections as dicts)."""
    v = cfg
    for part in key.split("."):
        v = v[part]
    return plain(v)


def undeclared(cfg: ConfigDict, schema: Schema, prefix: str = "") -> list[str]:
    """Keys of ``cfg`` the schema does not have (a config file's typo)."""
    out = []
    for name in cfg:
        entry = schema.get(name)
        if entry is None:
            out.append(prefix + name)
        elif isinstance(entry, dict) and isinstance(cfg[name], ConfigDict):
            out += undeclared(cfg[name], entry, f"{prefix}{name}.")
    return out


Relation = Callable[[ConfigDict], list[tuple[str, str]]]


def check(cfg: ConfigDict, schema: Schema, relations: list[Relation]) -> list[str]:
    """Every problem of ``cfg`` at once, one ``key = value: reason`` line each: values
    outside their key's domain, keys the schema lacks, then the relations' findings
    (``(key, reason)`` pairs) for configs whose keys are each in their domain."""
    lines = []
    for key, spec in keys(schema).items():
        try:
            value = value_at(cfg, key)
        except (KeyError, AttributeError):
            continue  # not in this config: the default applies where it is read
        why = spec.domain.error(value)
        if why:
            lines.append(f"{key} = {value!r}: {why}")
    lines += [f"{key}: not a config key (train/run/schema.py declares every key)"
              for key in undeclared(cfg, schema)]
    return lines or _findings(cfg, relations)


def _findings(cfg: ConfigDict, relations: list[Relation]) -> list[str]:
    return [f"{key} = {value_at(cfg, key)!r}: {why}"
            for relation in relations for key, why in relation(cfg)]


def enforce(cfg: ConfigDict, relations: list[Relation]) -> None:
    """Check ``relations`` on ``cfg`` where a module reads their keys.

    Raises:
      ValueError: their findings, one line each, as ``check`` words them.
    """
    lines = _findings(cfg, relations)
    if lines:
        raise ValueError("\n".join(lines))
