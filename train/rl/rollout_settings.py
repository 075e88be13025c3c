"""A run's rollout settings: ``cfg.rollout`` read once (``RolloutSettings.from_config``) and
handed to everything that samples, scores or exports (the GRPO step's sampler and groups,
the updates' temperature and completion budget, the held-out evaluation, the exported
``generation_config.json``), so that no two of them can read the section differently."""

from __future__ import annotations

import dataclasses

from train.rl.placement import Placement
from train.rl.rollout import Generator, Truncation
from train.rl.state import ModelDef


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
    """What ``cfg.rollout`` says, checked.

    Attributes:
      prompts_per_step: P, the prompts of a GRPO step.
      group_size: G, the completions sampled for each prompt.
      temperature: the sampling temperature (0: greedy); the trainer's log-probs are of
        the same tempered distribution.
      max_new_tokens: T, the completion budget in tokens (also the length that
        ``loss.aggregation = "seq-mean-token-sum-norm"`` divides by).
      truncation: ``top_k`` / ``top_p`` / ``min_p`` (``train.rl.rollout.Truncation``).
      engine, decode_chunk, page_size, max_decode_rows: the engine's settings
        (``train.rl.rollout.Generator``).
    """

    prompts_per_step: int
    group_size: int
    temperature: float
    max_new_tokens: int
    truncation: Truncation
    engine: str = "compact"
    decode_chunk: int = 64
    page_size: int = 64
    max_decode_rows: int = 0

    @classmethod
    def from_config(cls, cfg) -> RolloutSettings:
        """The settings of ``cfg.rollout``.

        Raises:
          ValueError: a truncation field outside its domain (``Truncation.check``, in the
            config check's words).
        """
        r = cfg.rollout
        return cls(int(r.prompts_per_step), int(r.group_size), float(r.temperature),
                   int(r.max_new_tokens),
                   Truncation(int(r.top_k), float(r.top_p), float(r.min_p)).check(),
                   str(r.engine), int(r.decode_chunk), int(r.page_size),
                   int(r.max_decode_rows))

    @property
    def rows(self) -> int:
        """The completions of a GRPO step, ``P * G``."""
        return self.prompts_per_step * self.group_size

    def generator(self, mdef: ModelDef, *, stop_ids: tuple[int, ...], num_valid: int,
                  placement: Placement | None = None, record_routes: bool = False,
                  truncation: Truncation | None = None) -> Generator:
        """A ``Generator`` with these settings (``truncation``: another truncation, e.g.
        none for the held-out evaluation; default the settings' own)."""
        return Generator(mdef, max_new_tokens=self.max_new_tokens, stop_ids=stop_ids,
                         num_valid=num_valid,
                         truncation=self.truncation if truncation is None else truncation,
                         placement=placement, engine=self.engine,
                         decode_chunk=self.decode_chunk, page_size=self.page_size,
                         max_decode_rows=self.max_decode_rows, record_routes=record_routes)

    def generation_config(self) -> dict:
        """The sampling fields of a Hugging Face ``generation_config.json`` that draw as
        the rollouts do: ``do_sample``, and when sampling ``temperature``, ``top_p``,
        ``top_k`` and ``min_p`` (when > 0)."""
        out: dict = {"do_sample": self.temperature > 0}
        if self.temperature > 0:
            t = self.truncation
            out.update(temperature=self.temperature, top_p=t.top_p, top_k=t.top_k)
            if t.min_p > 0:
                out["min_p"] = t.min_p
        return out
