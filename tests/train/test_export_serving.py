"""What a serving engine reads from an export besides the weights (``train.export
.save_serving_files``): the stop ids it keeps from the base checkpoint, ``top_k`` as its
readers take it, and a chat template that renders the prompts the trainer trained on."""

from __future__ import annotations

import json
import re

import pytest

from tests.support import ROOT
from train import export
from train.data import tasks as data
from train.data.tokenizer import LLAMA3_SPECIALS, Tokenizer, load_tokenizer, save_tokenizer
from train.run.schema import base_config

transformers = pytest.importorskip("transformers")

#: Llama 3.1 Instruct's generation_config.json: three end ids (<|end_of_text|>, <|eom_id|>,
#: <|eot_id|>) and its own sampling settings.
LLAMA31_GENERATION = {"bos_token_id": 128000, "do_sample": True,
                      "eos_token_id": [128001, 128008, 128009], "temperature": 0.6,
                      "top_p": 0.9}


def llama31_tokenizer() -> Tokenizer:
    """The trainer's view of Llama 3.1's tokenizer (its ids; no text is encoded here)."""
    return Tokenizer(name="llama-3.1", num_valid=128256, im_start_id=128006,
                     im_end_id=128009, eos_id=128001, encode_text=list, decode_ids=str,
                     chat_format="llama3", bos_id=128000, header_end_id=128007)


def run_config(tmp_path, **data_fields):
    cfg = base_config()
    cfg.rollout.temperature, cfg.rollout.top_p, cfg.rollout.top_k = 0.8, 0.95, 0
    for key, value in data_fields.items():
        setattr(cfg.data, key, value)
    cfg.workdir = str(tmp_path / "run")
    return cfg


def test_base_end_ids_are_kept_and_the_trainers_added(tmp_path):
    """Issue #42 item 2, from torchtune issue #1483 ("Add eom_id to stop tokens list") and
    llama.cpp PR #8858: from a Llama 3.1 Instruct base whose generation config lists
    [128001, 128008, 128009] the export said [128009, 128001], so a served model never
    stopped at <|eom_id|>. vLLM reads this list as stop ids (its PR #4182)."""
    base = tmp_path / "llama31"
    base.mkdir()
    (base / "generation_config.json").write_text(json.dumps(LLAMA31_GENERATION))
    cfg = run_config(tmp_path)
    cfg.model.hf_checkpoint = str(base)
    tok = llama31_tokenizer()
    got = export.generation_config(cfg, tok)
    # the base's ids, in its order; the run's sampling (not the base's temperature 0.6)
    assert got == {"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                   "pad_token_id": 128001, "do_sample": True, "temperature": 0.8,
                   "top_p": 0.95, "top_k": 0}
    # a base model's single end id (Llama 3.2 1B, in config.json only): the trainer's
    # end of turn is added
    (base / "generation_config.json").unlink()
    (base / "config.json").write_text(json.dumps({"bos_token_id": 128000,
                                                  "eos_token_id": 128001}))
    assert export.generation_config(cfg, tok)["eos_token_id"] == [128001, 128009]
    # written as transformers reads it
    out = tmp_path / "hf"
    out.mkdir()
    (out / "generation_config.json").write_text(json.dumps(export.generation_config(cfg, tok)))
    assert transformers.GenerationConfig.from_pretrained(out).eos_token_id == [128001, 128009]
    # an id the run's tokenizer does not have: named, never written
    (base / "config.json").write_text(json.dumps({"eos_token_id": [128001, 128300]}))
    with pytest.raises(ValueError, match=r"config.json: token ids \[128300\] are not in the "
                                         r"vocabulary of the run's tokenizer llama-3.1"):
        export.generation_config(cfg, tok)


def test_config_json_holds_the_same_ids_and_a_bad_base_writes_nothing(tmp_path):
    """``export_params`` from a checkpoint directory whose generation config lists an end
    id of its own (as Llama 3.1's <|eom_id|>): config.json and generation_config.json both
    hold the base's list and the trainer's ids; a base id outside the tokenizer stops the
    export before any file is written."""
    import tokenizers
    from tokenizers import models as tok_models

    from tests.support.models import random_model
    from train.rl import state
    from train.run import setup

    words = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|eom|>", "user", "assistant"]
    base = tmp_path / "base"
    base.mkdir()
    tok = tokenizers.Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)},
                                                    unk_token="<|endoftext|>"))
    tok.add_special_tokens(words[:4])
    tok.save(str(base / "tokenizer.json"))
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    cfg = run_config(tmp_path)
    cfg.model.preset, cfg.tokenizer = "tiny", str(base)
    model = random_model(setup.run_model_config(cfg))
    mdef, params = state.ModelDef.of(model.cfg), state.params_of(model)
    out = export.export_params(cfg, mdef, params, tmp_path / "hf")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 3, 2]
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in ("eos_token_id", "pad_token_id")} == {
        "eos_token_id": [0, 3, 2], "pad_token_id": 0}
    (base / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 99]}))
    with pytest.raises(ValueError, match=r"token ids \[99\] are not in the vocabulary"):
        export.export_params(cfg, mdef, params, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_top_k_off_is_off_for_the_readers_the_docs_name(tmp_path):
    """Issue #42 item 10, from vLLM issue #17553: ``top_k: 0`` in generation_config.json is
    "off" for transformers, refused by vLLM 0.8.5 ("top_k must be -1 (disable), or at least
    1, got 0"), accepted as off from vLLM 0.9.0 (PR #17773); an absent or null ``top_k`` is
    50 in transformers 5. The export writes 0, and docs/export.md names the vLLM version
    from which it is read as off."""
    import torch

    def vllm_accepts(version: tuple[int, ...], top_k: int) -> bool:
        """vLLM's SamplingParams check of top_k: -1 or >= 1 up to 0.8.5, >= -1 from 0.9.0."""
        return top_k >= -1 if version >= (0, 9, 0) else top_k == -1 or top_k >= 1

    cfg = run_config(tmp_path)
    cfg.rollout.top_p = 1.0
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1)).eval()
    for top_k in (0, 20):
        cfg.rollout.top_k = top_k
        written = export.generation_config(cfg, llama31_tokenizer())
        assert written["top_k"] == top_k  # never left out (transformers' 50)
        out = tmp_path / f"k{top_k}"
        out.mkdir()
        sampling = {k: written[k] for k in ("do_sample", "temperature", "top_p", "top_k")}
        (out / "generation_config.json").write_text(json.dumps({**sampling, "pad_token_id": 0}))
        model.generation_config = transformers.GenerationConfig.from_pretrained(out)
        step = model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=1,
                              return_dict_in_generate=True, output_scores=True)
        kept = int(torch.isfinite(step.scores[0]).sum())  # after the warpers
        assert kept == (64 if top_k == 0 else top_k), (top_k, kept)
    row = next(line for line in (ROOT / "docs/export.md").read_text().splitlines()
               if line.startswith("| `generation_config.json`"))
    found = re.search(r"vLLM (\d+)\.(\d+)\.(\d+)", row)
    assert found, f"docs/export.md names no vLLM version for generation_config.json: {row}"
    version = tuple(int(v) for v in found.groups())
    assert vllm_accepts(version, 0) and not vllm_accepts((0, 8, 5), 0)
    assert "0.9.0" in export.generation_config.__doc__


# ---- the chat template ------------------------------------------------------------------

#: An instruct checkpoint's template that adds a default system turn when the messages
#: bring none (Qwen2.5 Instruct's behaviour).
QWEN25_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message['role'] == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

#: An instruct checkpoint's template that writes a system turn with a knowledge-cutoff and
#: today's date line (Llama 3.2 Instruct's behaviour), in a chat_template.jinja file.
LLAMA32_LIKE = (
    "{{- bos_token }}\n"
    "{%- if strftime_now is defined %}{%- set date_string = strftime_now('%d %b %Y') %}\n"
    "{%- else %}{%- set date_string = '26 Jul 2024' %}{%- endif %}\n"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_message = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system_message = '' %}{%- endif %}\n"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Cutting Knowledge Date: December 2023\\nToday Date: ' + date_string + '\\n\\n' }}"
    "{{- system_message + '<|eot_id|>' }}\n"
    "{%- for message in messages %}{{- '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}\n"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}\n")

#: Llama 3's pre-tokenizer split (as in its tokenizer.json): newline runs are one piece.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: The held-out questions: three tasks of different wording (digits, words, letters).
TASKS = {"chain_sum": {"min_terms": 2, "max_terms": 4}, "word_sorting": {},
         "letter_counting": {}}
#: A system prompt with what a Jinja string literal must escape.
AWKWARD_SYSTEM = 'Answer in <answer> tags: "x" \\ {{ y }} {% z %} — café 🙂\n\tdone.'


def write_llama_instruct(directory) -> None:
    """A Llama 3 style tokenizer directory: a small byte-level BPE with Llama 3's split,
    markers and a BOS post-processor, its config and a Llama 3.2 Instruct style
    chat_template.jinja."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(LLAMA3_SPLIT), "isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    corpus = [data.SYSTEM_PROMPT, "What is 12 + 7?\n\nSort these words: apple, Banana",
              "How many times does the letter \"r\" appear in the text: \"strawberry\"?"]
    bpe.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[*LLAMA3_SPECIALS, "<|eom_id|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[
            ("<|begin_of_text|>", bpe.token_to_id("<|begin_of_text|>"))])
    directory.mkdir(parents=True)
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "model_max_length": 131072}))
    (directory / "chat_template.jinja").write_text(LLAMA32_LIKE)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, tuple[str, str | None]]:
    """Tokenizer spec -> the base's default chat template (None: it has none), one of each
    kind the config accepts: the offline Qwen BPE, a ChatML checkpoint directory (Qwen2.5
    Instruct style: the real Qwen BPE, a default system prompt in tokenizer_config.json)
    and a Llama 3 one (Llama 3.2 Instruct style)."""
    root = tmp_path_factory.mktemp("bases")
    qwen = root / "qwen2.5-instruct"
    save_tokenizer("qwen:qwen2.5-7b", qwen)
    config = json.loads((qwen / "tokenizer_config.json").read_text())
    (qwen / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "chat_template": QWEN25_LIKE}))
    (qwen / "chat_template.jinja").unlink(missing_ok=True)  # its template: the config's
    write_llama_instruct(root / "llama-3.2-instruct")
    return {"qwen:qwen2.5-7b": None, str(qwen): QWEN25_LIKE,
            str(root / "llama-3.2-instruct"): LLAMA32_LIKE}


@pytest.fixture(scope="module")
def questions() -> list[str]:
    tasks = data.Tasks(TASKS, load_tokenizer("qwen:qwen2.5-7b"), 10**6)
    return [p.question for p in tasks.eval_set(200, seed=3)]


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["qwen-bpe", "qwen2.5-dir", "llama3.2-dir"])
@pytest.mark.parametrize("system, prefill", [(data.SYSTEM_PROMPT, False), ("", True),
                                             (AWKWARD_SYSTEM, True)],
                         ids=["default-system", "no-system-prefill", "odd-system-prefill"])
def test_exported_chat_template_renders_the_trainers_prompts(tmp_path, bases, questions,
                                                             kind, system, prefill):
    """Issue #42 item 9, from LLaMA-Factory issue #5785 and QwenLM/Qwen3 issue #1141 (the
    trainer's Qwen2.5 prompt and the checkpoint's template disagree on the default system
    prompt): an export whose tokenizer is an instruct checkpoint's directory kept its
    template, so ``apply_chat_template([user], add_generation_prompt=True)`` differed from
    the trainer's ``Tasks.prompt_ids`` on 200 of 200 questions. Now, for every tokenizer
    kind, it equals them on 200 held-out questions; a system message given explicitly
    renders as the trainer's, and the base's template is kept unchanged by name."""
    spec, base_template = list(bases.items())[kind]
    cfg = run_config(tmp_path, system_prompt=system, prefill_answer_tag=prefill)
    cfg.tokenizer = spec
    out = tmp_path / "hf"
    names = export.save_serving_files(cfg, out)
    auto = transformers.AutoTokenizer.from_pretrained(out)
    tasks = data.Tasks(TASKS, load_tokenizer(spec), 10**6, system_prompt=system,
                       prefill_answer_tag=prefill)
    expected = [tasks.prompt_ids(q) for q in questions]
    got = auto.apply_chat_template([[{"role": "user", "content": q}] for q in questions],
                                   add_generation_prompt=True)["input_ids"]
    wrong = [q for q, a, b in zip(questions, got, expected, strict=True) if a != b]
    assert not wrong, f"{len(wrong)} of {len(questions)} prompts differ, e.g. {wrong[0]!r}"
    # an explicit system message: the trainer's prompt with that system turn
    explicit = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}]
    assert (auto.apply_chat_template(explicit, add_generation_prompt=True)["input_ids"]
            == tasks.tokenizer.chat_prompt("Be brief.", "1+2?")
            + tasks.tokenizer.encode(tasks.answer_prefix))
    # the base's own template, byte for byte, under the name "base"
    kept = out / "additional_chat_templates" / "base.jinja"
    if base_template is None:
        assert not kept.exists() and "additional_chat_templates/base.jinja" not in names
    else:
        assert kept.read_bytes() == base_template.encode()
        text = auto.apply_chat_template([{"role": "user", "content": "1+2?"}], tokenize=False,
                                        add_generation_prompt=True, chat_template="base")
        assert "You are Qwen" in text or "Today Date:" in text
    # tokenizer_config.json, for readers that know only its key, holds the same template
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (out / "chat_template.jinja").read_text()


@pytest.mark.parametrize("layout", ["config-string", "config-list", "jinja-files"])
def test_base_templates_are_read_as_transformers_reads_them(tmp_path, bases, layout):
    """``base_chat_templates`` against transformers' own loading, for each place a checkpoint
    keeps its templates; the export writes each unchanged, line ends included."""
    from train.data.tokenizer import base_chat_templates

    qwen_dir = list(bases)[1]
    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_bytes((ROOT / qwen_dir / "tokenizer.json").read_bytes())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>"}
    tool = "{{ 'tools: ' + messages[0]['content'] }}\r\n"
    if layout == "config-string":
        config["chat_template"] = QWEN25_LIKE
    elif layout == "config-list":
        config["chat_template"] = [{"name": "default", "template": QWEN25_LIKE},
                                   {"name": "tool_use", "template": tool}]
    else:
        (base / "chat_template.jinja").write_bytes(QWEN25_LIKE.replace("%}", "%}\r\n").encode())
        (base / "additional_chat_templates").mkdir()
        (base / "additional_chat_templates" / "tool_use.jinja").write_bytes(tool.encode())
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    found = base_chat_templates(base)
    loaded = transformers.AutoTokenizer.from_pretrained(base).chat_template
    lf = layout == "jinja-files"  # transformers reads files in Python's newline mode
    as_read = {name: text.replace("\r\n", "\n") if lf else text for name, text in found.items()}
    assert as_read == (loaded if isinstance(loaded, dict) else {"default": loaded})
    cfg = run_config(tmp_path)
    cfg.tokenizer = str(base)
    out = tmp_path / "hf"
    export.save_serving_files(cfg, out)
    kept = {"default": "base.jinja", "tool_use": "base_tool_use.jinja"}
    for name, text in found.items():
        assert (out / "additional_chat_templates" / kept[name]).read_bytes() == text.encode()
    assert set(transformers.AutoTokenizer.from_pretrained(out).chat_template) == {
        "default", *(f"base{'' if n == 'default' else '_' + n}" for n in found)}


def test_a_second_export_leaves_no_stale_tokenizer_file(tmp_path, bases):
    """An export into a directory that holds an earlier one (a checkpoint directory's
    template files, then the offline Qwen BPE's): nothing of the first is read beside the
    second (transformers would take a stale ``additional_chat_templates/`` file as a named
    template)."""
    qwen, _, llama = bases
    out = tmp_path / "hf"
    for spec in (llama, qwen):
        cfg = run_config(tmp_path)
        cfg.tokenizer = spec
        names = export.save_serving_files(cfg, out)
    on_disk = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert on_disk == sorted(names)
    assert isinstance(transformers.AutoTokenizer.from_pretrained(out).chat_template, str)
