"""Rollouts with the KV cache (``models.cache``), one folder like the op folders.

  api.py          what the engines share: ``Decoding``, ``Truncation``, the draw of a
                  step by global row index, ``Work``
  reference.py    ``"reference"``: the whole batch decodes until its longest row stops
                  (``ReferenceEngine``)
  compact.py      ``"compact"``: one prefill per prompt into a paged KV cache its
                  samples share, finished rows leave the batch between chunks of steps
                  (a static row ladder), waiting rows take their places
  pages.py        ``PageAllocator``: the host's bookkeeping of the page pool

The trainer's use of them (placement, host arrays, ``Rollout``) is ``train.rl.rollout``.
"""

from models.generate.api import (
    Decoding,
    EngineSettings,
    Layout,
    Truncation,
    Work,
)
from models.generate.compact import CompactEngine, Rows
from models.generate.reference import ReferenceEngine

#: The engines by name (``IMPLEMENTATIONS``), each of one shape: ``Engine(merge, d,
#: settings, *, jit, read, place, layout)``, called as ``engine(params, prompts, lens,
#: budgets, key, temperature, trunc, *, group_size, request_ids) -> (record, Work)``, its
#: compiled functions ``engine.compiled(name, static)`` (``.lower(...)``: the program).
ENGINES = {"reference": ReferenceEngine, "compact": CompactEngine}

#: Their names: ``rollout.engine``'s domain (``train.rl.rollout.ENGINE``).
IMPLEMENTATIONS = tuple(ENGINES)

__all__ = ["ENGINES", "IMPLEMENTATIONS", "CompactEngine", "Decoding", "EngineSettings",
           "Layout", "ReferenceEngine", "Rows", "Truncation", "Work"]
