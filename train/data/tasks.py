"""Prompts and rewards from reasoning-gym tasks, with a held-out eval set.

* ``Tasks``: the configured reasoning-gym datasets. A training stream and an eval set come
  from different seeds, and the training stream skips every question text in the eval
  set. (Different seeds alone are not enough: many reasoning-gym generators seed item
  ``i`` with ``seed + i``, so two seeds' streams share items, and small task spaces
  repeat questions.)
* ``prompt_ids``: a ChatML prompt (by default its system turn asks for the final answer
  in ``<answer>`` tags);
  optionally the assistant turn is pre-filled with the opening ``<answer>`` tag
  (``answer_prefix``), which saves generating and scoring three format tokens per
  completion; optionally generation stops at the token that opens ``</answer>`` (a stop
  sequence, as ``stop=["</answer>"]`` in serving engines), and the reply is completed
  with the rest of the tag before scoring: two more tokens saved.
* ``reward``: the task's own ``score_answer`` on the extracted answer, plus an optional
  format reward, of the reply as the row ended (``reply``): a row the budget cut off is
  scored on its partial text, never completed to a closed answer it did not write (in
  the Qwen BPE ``" </"`` is one token that is not the stop id: a text ending in ``"</"``
  says nothing of how the row ended). Serving engines report it the same way, as the
  finish reason ``"stop"`` or ``"length"``, and strip a stop sequence only when the row
  stopped on it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator, Sequence

from train.data.tokenizer import Tokenizer

#: How far apart the training streams of two run seeds start (``training_seed``): more
#: positions than any run draws, so different run seeds never share an item.
SEED_STRIDE = 10**7


def training_seed(train_seed: int, run_seed: int) -> int:
    """The reasoning-gym seed of a run's training stream: ``train_seed + SEED_STRIDE *
    run_seed``. The run's ``seed`` thus changes the data order (with the model init and
    the sampling noise) while ``seed = 0`` keeps ``data.train_seed``'s stream; the eval set
    (``data.eval_seed``) is the same for every run seed."""
    return train_seed + SEED_STRIDE * run_seed


SYSTEM_PROMPT = (
    "Solve the problem. Reply with only the final answer inside <answer> </answer> tags."
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_WELL_FORMED = re.compile(r"\s*<answer>[^<]*</answer>\s*", re.DOTALL)


def answer_prefix(prefill_answer_tag: bool) -> str:
    """What a prompt ends with inside the opened assistant turn: ``<answer>`` with
    ``data.prefill_answer_tag``, else nothing (``Tasks.prompt_ids``; the exported chat
    template's generation prompt, ``train.export``)."""
    return "<answer>" if prefill_answer_tag else ""


def available_tasks() -> list[str]:
    """Names of every registered reasoning-gym dataset."""
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


def _cut(text, limit: int = 120):
    """``text`` for an error message: at most ``limit`` characters."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclasses.dataclass(frozen=True)
class Problem:
    """One question: its task, the reasoning-gym entry, and the prompt ids."""

    task: str
    entry: dict
    prompt: tuple[int, ...]

    @property
    def question(self) -> str:
        return self.entry["question"]

    @property
    def answer(self) -> str:
        return self.entry["answer"]


def extract_answer(text: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` in ``text``, or None."""
    found = _ANSWER.findall(text)
    return found[-1].strip() if found else None


def completion_text(answer: str) -> str:
    """The target completion of supervised warm starts: ``<answer>{answer}</answer>``."""
    return f"<answer>{answer}</answer>"


class Tasks:
    """The configured reasoning-gym datasets and their prompts.

    Args:
      specs: ``{task name: dataset kwargs}`` (e.g. ``{"chain_sum": {"min_terms": 2}}``);
        tasks take turns in the order given.
      tokenizer: builds the prompts.
      max_prompt_len: prompts longer than this many tokens are skipped and counted
        (``skipped``), never truncated.
      pool_size: virtual size of each dataset (items are generated on demand; position
        ``i`` of a stream wraps around it).
      prefill_answer_tag: end every prompt with ``<answer>`` (the start of the assistant
        reply): completions then hold the answer, ``</answer>`` and the stop token.
      stop_at_close_tag: the first token of ``</answer>`` (``close_id``, ``"</"`` in the
        Qwen BPE) is a stop token too (``stop_ids``): supervised targets end with it,
        and a reply that stopped on it is scored as if it went on with ``answer>``
        (``reply``).
      system_prompt: the ChatML system turn of every prompt; ``""`` leaves the turn out.

    Raises:
      ValueError: an unknown task (every valid name listed), or a dataset config the task
        rejects (the task named).
    """

    def __init__(self, specs: dict[str, dict], tokenizer: Tokenizer, max_prompt_len: int,
                 pool_size: int = 10**7, prefill_answer_tag: bool = False,
                 stop_at_close_tag: bool = False, system_prompt: str = SYSTEM_PROMPT):
        import reasoning_gym

        valid = available_tasks()
        unknown = [name for name in specs if name not in valid]
        if unknown or not specs:
            raise ValueError(
                f"unknown reasoning-gym task(s) {unknown or '(none given)'}; valid names: "
                f"{', '.join(valid)}"
            )
        self.names = list(specs)
        self.specs = {name: dict(kw) for name, kw in specs.items()}
        self.tokenizer, self.max_prompt_len, self.pool_size = tokenizer, max_prompt_len, pool_size
        self.answer_prefix = answer_prefix(prefill_answer_tag)
        self.system_prompt = system_prompt
        self.close_id = tokenizer.encode("</answer>")[0] if stop_at_close_tag else None
        self._datasets: dict[tuple[str, int], object] = {}
        self._create = reasoning_gym.create_dataset
        self.skipped = 0

    def dataset(self, task: str, seed: int):
        """The reasoning-gym dataset of ``task`` for ``seed`` (cached)."""
        key = (task, seed)
        if key not in self._datasets:
            try:
                self._datasets[key] = self._create(
                    task, size=self.pool_size, seed=seed, **self.specs[task])
            except (TypeError, AssertionError, ValueError) as err:
                raise ValueError(f"task {task!r}: bad config {self.specs[task]}: {err}") from err
        return self._datasets[key]

    def prompt_ids(self, question: str) -> list[int]:
        """The ChatML prompt of ``question`` (the system turn when ``system_prompt`` is not
        empty, the user question, then the opened assistant turn and ``answer_prefix``)."""
        prompt = self.tokenizer.chat_prompt(self.system_prompt, question)
        return prompt + self.tokenizer.encode(self.answer_prefix)

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Generation stops after any of these: the tokenizer's end tokens, and
        ``close_id`` with ``stop_at_close_tag``."""
        extra = () if self.close_id is None else (self.close_id,)
        return tuple(self.tokenizer.stop_ids) + extra

    def target_ids(self, answer: str) -> list[int]:
        """The supervised completion of ``answer``: ``<answer>{answer}</answer>`` without
        the pre-filled prefix, then ``<|im_end|>``; with ``stop_at_close_tag``, cut after
        the close tag's first token (when the BPE keeps it a separate token)."""
        text = completion_text(answer)[len(self.answer_prefix):]
        ids = self.tokenizer.encode(text)
        if self.close_id is not None:
            head = len(self.tokenizer.encode(text[: text.rindex("</answer>")]))
            if self.close_id in ids[head - 1:]:
                return ids[: ids.index(self.close_id, max(head - 1, 0)) + 1]
        return ids + [self.tokenizer.im_end_id]

    def problem_at(self, seed: int, position: int) -> Problem | None:
        """The problem at ``position`` of the stream for ``seed`` (tasks take turns), or
        None when its prompt exceeds ``max_prompt_len`` (then ``skipped`` grows by one)."""
        task = self.names[position % len(self.names)]
        entry = self.dataset(task, seed)[(position // len(self.names)) % self.pool_size]
        prompt = self.prompt_ids(entry["question"])
        if len(prompt) > self.max_prompt_len:
            self.skipped += 1
            return None
        return Problem(task, entry, tuple(prompt))

    def eval_set(self, size: int, seed: int) -> list[Problem]:
        """``size`` problems with distinct question texts, drawn from the stream of ``seed``.

        Raises:
          ValueError: the task space has fewer than ``size`` distinct questions within
            ``20 * size`` draws.
        """
        out, seen = [], set()
        for position in range(20 * size):
            p = self.problem_at(seed, position)
            if p is not None and p.question not in seen:
                seen.add(p.question)
                out.append(p)
                if len(out) == size:
                    return out
        raise ValueError(f"only {len(out)} distinct eval questions in {20 * size} draws of "
                         f"{self.names}: the task space is too small for eval size {size}")

    def train_stream(self, seed: int, exclude: set[str], start: int = 0
                     ) -> Iterator[tuple[int, Problem]]:
        """``(next position, problem)`` from ``start`` on, skipping questions in
        ``exclude`` (the eval set) and over-long prompts. Resuming at a saved position
        continues the same sequence."""
        position = start
        while True:
            p = self.problem_at(seed, position)
            position += 1
            if p is not None and p.question not in exclude:
                yield position, p

    def reply(self, completion: Sequence[int], stopped: bool) -> str:
        """The reply a completion is scored as: ``answer_prefix`` and its decoded tokens.
        A row that ``stopped`` on one of ``stop_ids`` (its last token) loses an end token
        and has ``close_id`` completed to ``</answer>``; a row that did not stop (cut by
        the budget) is its partial text as written.

        Args:
          completion: the sampled ids of the row, its stop token included.
          stopped: the row ended with a stop token (``rollout.Rollout.stopped``).

        Raises:
          ValueError: ``stopped`` and the last id is none of ``stop_ids``, or not
            ``stopped`` and it is one (the sampler stops at the first stop id it draws);
            the ids named.
        """
        ids = list(completion)
        if stopped != bool(ids and ids[-1] in self.stop_ids):
            raise ValueError(
                f"a completion that {'stopped' if stopped else 'did not stop'} must "
                f"{'' if stopped else 'not '}end with one of the stop ids {self.stop_ids}; "
                f"it ends with {ids[-1:]}")
        close = ""
        if stopped:
            close = "</answer>" if ids[-1] == self.close_id else ""
            ids = ids[:-1]
        return self.answer_prefix + self.tokenizer.decode(ids) + close

    def reward(self, problem: Problem, completion: Sequence[int], stopped: bool,
               format_weight: float = 0.0) -> float:
        """``score_answer(extracted answer, entry)`` of the problem's task (0 when there is
        no closed ``<answer>`` tag) on ``reply(completion, stopped)``, plus
        ``format_weight`` if that reply is exactly one well-formed
        ``<answer>...</answer>``. A row cut by the budget keeps only what it wrote: with
        ``stop_at_close_tag`` its last token may read ``"</"`` and still not be the stop
        id (module docstring).

        Args:
          completion, stopped: as ``reply``.

        Returns:
          The reward, a finite float.

        Raises:
          ValueError: a non-finite score (task, problem and answer named), or a
            ``completion`` that ``stopped`` without a stop id (``reply``).
        """
        text = self.reply(completion, stopped)
        answer = extract_answer(text)
        score = 0.0
        if answer is not None:
            ds = self.dataset(problem.task, 0)
            score = float(ds.score_answer(answer, problem.entry))
        if format_weight and _WELL_FORMED.fullmatch(text):
            score += format_weight
        if not math.isfinite(score):  # a NaN advantage would reach every weight
            raise ValueError(
                f"task {problem.task!r} scored a non-finite reward {score!r} for the problem "
                f"{_cut(problem.question)!r} with the answer {_cut(answer)!r}")
        return score
