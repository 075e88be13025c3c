"""Command line: ``--config=configs/x.py`` plus ``--config.a.b=value`` overrides (absl +
ml_collections, as in the Flax examples), with a clear error for an unknown key.

An entry point is ``main(argv)`` calling its trainer with ``config()``, started by
``run(main)``.
"""

from __future__ import annotations

import importlib.util
import sys

from absl import app, flags, logging
from ml_collections import ConfigDict, config_flags

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)


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


def _config_path(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a.startswith("--config="):
            return a.split("=", 1)[1]
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parser for ``app.run(main, flags_parser=parse_flags)``.

    An override of a key the config does not have exits with status 2 and the list of
    valid keys (instead of a traceback).
    """
    try:
        return flags.FLAGS(argv)
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
                    msg = (f"error: unknown config key(s) {unknown} for {path}.\n"
                           f"Valid keys:\n  " + "\n  ".join(keys))
        print(msg, file=sys.stderr)
        sys.exit(2)


def config() -> ConfigDict:
    """The parsed config (after ``parse_flags``)."""
    return _CONFIG.value


def run(main) -> None:
    """``app.run(main)`` with this module's flag parser; orbax's INFO logs (one per save)
    are silenced."""
    logging.set_verbosity(logging.WARNING)
    app.run(main, flags_parser=parse_flags)
