"""train.data.tasks / train.data.tokenizer / train.run.metrics: held-out eval set, bad input, rewards,
resume-safe metrics files."""

from __future__ import annotations

import json

import pytest

from train.data import tasks as data
from train.data.tokenizer import LLAMA3_SPECIALS, hf_tokenizer, qwen_bpe
from train.run.metrics import MetricsWriter

SPEC = {"chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}}


@pytest.fixture(scope="module")
def tok():
    return qwen_bpe()


def test_qwen_tokenizer_and_chat_prompt(tok):
    assert tok.num_valid == 151646 and tok.eos_id == 151643
    assert tok.stop_ids == (151645, 151643)
    ids = tok.chat_prompt("sys", "What is 12 + 7?")
    assert ids[0] == tok.im_start_id and ids.count(tok.im_end_id) == 2
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert [tok.decode([i]) for i in tok.encode("1234")] == ["1", "2", "3", "4"]
    # special-token text inside a question stays plain text
    assert tok.im_end_id not in tok.encode("<|im_end|>")


#: Meta's chat template of Llama 3 Instruct (its tokenizer_config.json).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] "
    "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")


def test_llama3_tokenizer_writes_meta_chat_format(tmp_path):
    """A checkpoint tokenizer with Llama 3's markers and no ChatML ones: prompts in Meta's
    format (the ids of its chat template, rendered and encoded), turns end with
    ``<|eot_id|>``; one with neither is refused naming both sets."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    jinja2 = pytest.importorskip("jinja2")  # (torch's dependency)

    bpe = tokenizers.Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = ["system\n\nBe brief.", "user\n\nWhat is 12 + 7?", "assistant\n\n19"]
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(LLAMA3_SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.save(str(tmp_path / "tokenizer.json"))
    tok = hf_tokenizer(tmp_path)
    assert tok.chat_format == "llama3"
    assert tok.stop_ids == (bpe.token_to_id("<|eot_id|>"), bpe.token_to_id("<|end_of_text|>"))
    for system in ("Be brief.", ""):
        messages = [{"role": "system", "content": system}] if system else []
        text = jinja2.Template(LLAMA3_TEMPLATE).render(
            messages=[*messages, {"role": "user", "content": "What is 12 + 7?"}],
            bos_token="<|begin_of_text|>", add_generation_prompt=True)
        expected = bpe.encode(text, add_special_tokens=False).ids
        assert tok.chat_prompt(system, "What is 12 + 7?") == expected, text
    bare = tokenizers.Tokenizer(models.BPE())
    bare.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=r"special tokens \['<\|im_start\|>'.*nor all of "
                                         r"Llama 3's \['<\|begin_of_text\|>'"):
        hf_tokenizer(tmp_path)


def test_system_prompt_is_configurable_and_can_be_left_out(tok):
    default = data.Tasks(SPEC, tok, 128).prompt_ids("What is 1 + 2?")
    assert tok.decode(default).startswith(f"<|im_start|>system\n{data.SYSTEM_PROMPT}<|im_end|>")
    bare = data.Tasks(SPEC, tok, 128, system_prompt="").prompt_ids("What is 1 + 2?")
    assert tok.decode(bare) == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert default[-len(bare):] == bare and len(bare) < len(default) - 15


def test_unknown_task_lists_valid_names(tok):
    with pytest.raises(ValueError, match="valid names: .*chain_sum.*word_sorting"):
        data.Tasks({"chain_summ": {}}, tok, 128)


def test_eval_set_is_held_out(tok):
    tasks = data.Tasks(SPEC, tok, 128)
    ev = tasks.eval_set(300, seed=2)
    questions = [p.question for p in ev]
    assert len(set(questions)) == 300
    # chain_sum seeds item i with seed + i: another seed's stream repeats eval items ...
    train_seed_items = {tasks.problem_at(1, i).question for i in range(2000)}
    assert train_seed_items & set(questions)
    # ... and the training stream skips every one of them
    stream = tasks.train_stream(1, set(questions))
    drawn = [next(stream)[1].question for _ in range(2000)]
    assert not set(drawn) & set(questions)


def test_run_seed_changes_the_training_stream_not_the_eval_set(tok):
    tasks = data.Tasks(SPEC, tok, 128)
    assert data.training_seed(1, 0) == 1  # seed 0 keeps data.train_seed's stream
    streams = [[p.question for _, (_, p) in zip(range(200), tasks.train_stream(
        data.training_seed(1, seed), set()))] for seed in (0, 1, 2)]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert sum(x == y for x, y in zip(streams[a], streams[b])) < 20  # not the same order
    # the stride keeps two run seeds' item seeds (seed + i) apart for every position drawn
    assert data.training_seed(1, 1) - data.training_seed(1, 0) >= 10**7


def test_long_prompts_are_skipped_and_counted(tok):
    tasks = data.Tasks({"chain_sum": {"min_terms": 2, "max_terms": 12}}, tok, 60)
    stream = tasks.train_stream(1, set())
    got = [next(stream) for _ in range(20)]
    assert all(len(p.prompt) <= 60 for _, p in got)
    assert tasks.skipped > 0
    assert got[-1][0] == 20 + tasks.skipped  # positions count the skipped ones too


def test_resumed_stream_continues_the_sequence(tok):
    tasks = data.Tasks(SPEC, tok, 128)
    full = [(pos, p.question) for pos, p in
            (next(s) for s in [tasks.train_stream(1, set())] * 10)]
    resumed = tasks.train_stream(1, set(), start=full[4][0])
    assert [p.question for _, p in (next(resumed) for _ in range(5))] == [
        q for _, q in full[5:]]


def test_reward_and_extraction(tok):
    tasks = data.Tasks(SPEC, tok, 128)
    p = tasks.eval_set(1, seed=3)[0]

    def reward(t, problem, text, **kw):  # a row that stopped on <|im_end|>
        return t.reward(problem, tok.encode(text) + [tok.im_end_id], True, **kw)

    right = f"<answer>{p.answer}</answer>"
    assert reward(tasks, p, right) == 1.0
    assert reward(tasks, p, "the answer is " + p.answer) == 0.0  # no tag, no reward
    assert reward(tasks, p, right, format_weight=0.1) == pytest.approx(1.1)
    assert reward(tasks, p, "x <answer>1000</answer> <answer>" + p.answer + "</answer>") == 1.0
    assert data.extract_answer("<answer> 7 </answer>") == "7"
    prefilled = data.Tasks(SPEC, tok, 128, prefill_answer_tag=True)
    q = prefilled.eval_set(1, seed=3)[0]
    assert tok.decode(q.prompt).endswith("assistant\n<answer>")
    assert prefilled.reward(q, prefilled.target_ids(q.answer), True) == 1.0
    with pytest.raises(ValueError, match=r"that stopped must end with one of the stop ids "
                                         r".* it ends with \[16\]"):
        tasks.reward(p, tok.encode("1"), True)
    with pytest.raises(ValueError, match=r"did not stop must not end with one of the stop "
                                         rf"ids .* it ends with \[{tok.im_end_id}\]"):
        tasks.reward(p, [16, tok.im_end_id], False)


def test_stop_at_close_tag(tok):
    tasks = data.Tasks(SPEC, tok, 128, prefill_answer_tag=True, stop_at_close_tag=True)
    q = tasks.eval_set(1, seed=3)[0]
    close = tok.encode("</answer>")[0]
    assert tasks.stop_ids == (*tok.stop_ids, close)
    target = tasks.target_ids(q.answer)
    assert target[-1] == close and close not in target[:-1]
    assert tok.decode(target) == q.answer + tok.decode([close])
    # a reply that stopped at the close tag is scored as a closed tag, with format reward
    assert tasks.reward(q, target, True, format_weight=0.5) == 1.5
    assert tasks.reply(target, True) == f"<answer>{q.answer}</answer>"
    closed = tok.encode(q.answer + "</answer>") + [tok.im_end_id]
    assert tasks.reward(q, closed, True) == 1.0
    assert tasks.reward(q, closed[:-1], False) == 1.0  # cut after writing the whole tag
    assert tasks.reward(q, tok.encode(q.answer), False) == 0.0  # never closed: no answer


@pytest.mark.parametrize("reply", ["-4 </", "-4></", "-4)</"])
def test_a_completion_cut_by_the_budget_is_never_completed(tok, reply):
    """Issue 42 item 7 (the truncation reports of other RL stacks: a row the length budget
    cut off rewarded as if it had finished): with ``data.stop_at_close_tag`` a completion
    whose text ended in ``"</"`` was completed to ``</answer>`` from its text alone. In
    the Qwen BPE ``" </"`` (id 690) is one token and not the stop id, so ``"-4" + " </"``
    cut by the budget scored 1.1 (full reward plus format) on a chain_sum problem whose
    answer is -4, and ``"></"`` / ``")</"`` 0.767. Now a row that did not stop is scored on
    what it wrote: no closed answer, 0; the answer followed by the close tag's own token
    (the stop id) is completed and scored 1.1."""
    tasks = data.Tasks({"chain_sum": {}}, tok, 256, prefill_answer_tag=True,
                       stop_at_close_tag=True)
    q = next(p for p in tasks.eval_set(300, seed=3) if p.answer == "-4")
    ids = tok.encode(reply)
    assert ids[-1] not in tasks.stop_ids and tok.decode(ids).endswith("</")
    assert reply != "-4 </" or ids[-1] == 690
    assert tasks.reward(q, ids, False, format_weight=0.1) == 0.0
    assert tasks.reply(ids, False) == "<answer>" + reply
    stopped = tok.encode("-4") + [tasks.close_id]
    assert tasks.reward(q, stopped, True, format_weight=0.1) == pytest.approx(1.1)


def test_metrics_writer_never_duplicates_and_drops_partial_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    w = MetricsWriter(path, tensorboard=False)
    assert w.write(1, {"a": 1.0}) and w.write(2, {"a": 2.0, "path": "x"})
    with open(path, "a") as f:
        f.write('{"kind": "train", "step": 3, "a"')  # cut by a kill
    w2 = MetricsWriter(path, tensorboard=False)
    assert not w2.write(2, {"a": 9.0})
    assert w2.write(3, {"a": 3.0})
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r["a"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert recs[1]["path"] == "x"


def _terms(problem) -> int:
    return problem.entry["metadata"]["num_terms"]


def _micro_run(tmp_path, data_kwargs: dict, sft_kwargs: dict, **eval_):
    """``(cfg, setup, training seed)`` of the micro config with these task splits."""
    from tests.support import ROOT
    from train.config.cli import load_config
    from train.data.tasks import training_seed
    from train.run import setup

    cfg = load_config(str(ROOT / "configs" / "grpo_micro.py"))
    cfg.workdir, cfg.metrics.tensorboard = str(tmp_path / "run"), False
    cfg.data.task_kwargs, cfg.sft.task_kwargs = data_kwargs, sft_kwargs
    for key, value in eval_.items():
        setattr(cfg.eval, key, value)
    return cfg, setup.build(cfg), training_seed(cfg.data.train_seed, cfg.seed)


def test_sft_stage_draws_its_own_problems(tmp_path):
    """``sft.task_kwargs``: the SFT stage trains on easier instances of the task (2 terms)
    while GRPO and the held-out set keep ``data.task_kwargs``' (3 terms), the split of the
    main job (issue 44: the warm start must leave GRPO something to teach). A dataset
    config the task rejects fails in ``setup.build``, naming the task, before any work."""
    from train.run import setup

    cfg, s, seed = _micro_run(tmp_path, {"chain_sum": {"min_terms": 3, "max_terms": 3}},
                              {"chain_sum": {"min_terms": 2, "max_terms": 2, "max_digits": 1}})
    sft = [p for _, (_, p) in zip(range(100), s.stage_tasks("sft").train_stream(seed, s.exclude))]
    grpo = [p for _, (_, p) in zip(range(100), s.stage_tasks("grpo").train_stream(seed,
                                                                                  s.exclude))]
    assert {_terms(p) for p in sft} == {2} and {_terms(p) for p in grpo} == {3}
    assert {_terms(p) for p in s.eval_problems} == {3}
    assert s.stage_tasks("grpo") is s.tasks
    banner = setup.banner(cfg, s, "train.grpo")
    assert "max_terms': 3" in banner and "(SFT: chain_sum {" in banner, banner
    cfg.sft.task_kwargs = {"chain_sum": {"min_terms": 0}}
    with pytest.raises(ValueError, match="task 'chain_sum': bad config"):
        setup.build(cfg)


def test_an_sft_stage_that_covers_the_held_out_distribution_never_draws_a_held_out_question(
        tmp_path):
    """The main job's SFT stage (sums of 2 to 4 terms) contains GRPO's held-out
    distribution (4 terms): the stage's stream, as the loop draws it (``stage_tasks("sft")``
    with ``exclude``), skips every held-out question text, and would draw some without it."""
    one_digit = {"min_digits": 1, "max_digits": 1}
    _, s, seed = _micro_run(tmp_path, {"chain_sum": {"min_terms": 2, "max_terms": 2, **one_digit}},
                            {"chain_sum": {"min_terms": 2, "max_terms": 3, **one_digit}},
                            size=64)
    held_out = {p.question for p in s.eval_problems}
    assert len(held_out) == 64 and s.exclude == held_out
    sft = s.stage_tasks("sft")
    drawn = [p for _, (_, p) in zip(range(3000), sft.train_stream(seed, s.exclude))]
    assert {_terms(p) for p in drawn} == {2, 3}  # the held-out kind among them
    assert not {p.question for p in drawn} & held_out
    unfiltered = [p.question for _, (_, p) in zip(range(3000), sft.train_stream(seed, set()))]
    assert set(unfiltered) & held_out  # the check can fail: the same stream meets them
