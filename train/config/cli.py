"""Command line: ``--config=configs/x.py`` plus ``--config.a.b=value`` overrides (absl +
ml_collections, as in the Flax examples).

* ``--print_config`` prints the resolved config, every key with its value (one
  ``key = value`` line each, in the syntax of an override), and exits with status 0;
  ``--help`` / ``--helpfull`` list the config's keys too and exit with status 0.
* Errors are one line (or a list of valid keys) on stderr, no traceback: a config file
  that does not exist or a missing ``--config`` (status 2), an override of a key the
  config does not have (status 2: the closest valid keys, every valid key, then the error
  line again). Values outside their key's domain (a negative temperature, an unknown
  task, a missing checkpoint directory) are all reported at once, one ``error:`` line
  each, before any work (status 2, ``train.run.setup.start``), and so is a resumed run whose
  config differs from the saved one in a value that changes the results.
* Output piped to a reader that closes early (``--helpfull | head``) ends the program
  quietly (status 141, as a SIGPIPE would), without a ``BrokenPipeError`` traceback.

An entry point is ``main(argv)`` calling its trainer with ``config()``, started by
``run(main)``.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import sys

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "config file (configs/*.py); override keys with --config.KEY=VALUE",
    lock_config=True)
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "print the resolved config (every key = value) and exit")
_HELP = ("--help", "--helpfull", "--helpshort", "--helpxml", "-?", "-h")


def leaf_keys(cfg: ConfigDict, prefix: str = "") -> list[str]:
    """Dotted names of every leaf of ``cfg`` (``"optim.lr"``, ...)."""
    out = []
    for k, v in cfg.items():
        name = f"{prefix}{k}"
        if isinstance(v, ConfigDict) and len(v):
            out += leaf_keys(v, name + ".")
        else:
            out.append(name)
    return out


def load_config(path: str) -> ConfigDict:
    """``get_config()`` of the config file ``path`` (what ``--config=path`` gives before
    overrides)."""
    spec = importlib.util.spec_from_file_location("_jaxhead_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def resolved(cfg: ConfigDict) -> str:
    """Every leaf of ``cfg`` as a ``key = value`` line (``repr`` values: the override
    syntax, e.g. ``data.tasks = ('chain_sum',)``)."""
    lines = []
    for key in leaf_keys(cfg):
        value = cfg
        for part in key.split("."):
            value = value[part]
        if isinstance(value, ConfigDict):  # an empty section
            value = {}
        lines.append(f"{key} = {value!r}")
    return "\n".join(lines)


def _config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _fail(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def _file_exists(path: str) -> bool:
    """Whether the config file of ``--config=path`` exists (``file.py:args`` too)."""
    return os.path.isfile(path) or os.path.isfile(path.rpartition(":")[0] or path)


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parser for ``app.run(main, flags_parser=parse_flags)``.

    ``--print_config`` and the help flags exit with status 0 (see the module docstring);
    a missing config file, a missing ``--config`` or an override of a key the config
    does not have exit with status 2 and a message instead of a traceback.
    """
    path = _config_path(argv)
    if path is not None and not _file_exists(path):
        _fail(f"error: config file {path!r} does not exist (--config=PATH, e.g. "
              f"--config=configs/grpo_tiny.py)")
    wants_help = any(a.split("=", 1)[0] in _HELP for a in argv[1:])
    if path is None and not wants_help:
        _fail("error: --config=PATH is required, e.g. --config=configs/grpo_tiny.py")
    if wants_help:
        try:
            flags.FLAGS(argv)
        except SystemExit:  # absl's help flags exit with status 1 after printing
            pass
        if path is not None:
            print(f"\nConfig keys of {path} (override with --config.KEY=VALUE):\n"
                  + resolved(load_config(path)))
        else:
            print("\nPass --config=FILE --print_config to list a config's keys and values.")
        sys.stdout.flush()  # a closed reader is found here, not at exit
        sys.exit(0)
    try:
        rest = flags.FLAGS(argv)
    except (AttributeError, KeyError, flags.Error) as err:
        path = _config_path(argv)
        bad = [a.split("=", 1)[0][len("--config."):] for a in argv
               if a.startswith("--config.")]
        msg = f"error: {err}"
        if path is not None:
            try:
                keys = leaf_keys(load_config(path))
            except Exception:  # noqa: BLE001 (the config itself is broken: show the error)
                keys = None
            if keys is not None:
                unknown = [b for b in bad if b not in keys]
                if unknown:
                    close = {b: difflib.get_close_matches(b, keys, n=3) for b in unknown}
                    hint = "; ".join(f"{b!r}: did you mean {' or '.join(map(repr, c))}?"
                                     for b, c in close.items() if c)
                    line = (f"error: unknown config key(s) {unknown} for {path}"
                            + (f" ({hint})" if hint else ""))
                    # the error line last too: it stays on screen below the list
                    msg = f"{line}\nValid keys:\n  " + "\n  ".join(keys) + f"\n{line}"
        _fail(msg)
    if _PRINT_CONFIG.value:
        print(resolved(config()))
        sys.stdout.flush()
        sys.exit(0)
    return rest


def config() -> ConfigDict:
    """The parsed config (after ``parse_flags``)."""
    return _CONFIG.value


def config_file() -> str:
    """The ``--config`` argument (after ``parse_flags``)."""
    return config_flags.get_config_filename(flags.FLAGS["config"])


#: The exit status of a program whose output reader went away (128 + SIGPIPE).
BROKEN_PIPE = 141


def run(main) -> None:
    """``app.run(main)`` with this module's flag parser and ``--config`` required;
    orbax's INFO logs (one per save) are silenced. A closed stdout reader ends the
    program quietly with status ``BROKEN_PIPE``."""
    flags.mark_flag_as_required("config")
    logging.set_verbosity(logging.WARNING)
    try:
        app.run(main, flags_parser=parse_flags)
    except BrokenPipeError:
        # stdout's buffer cannot be flushed any more: point it at /dev/null so that the
        # interpreter's own flush at exit has nowhere to fail
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(BROKEN_PIPE)
