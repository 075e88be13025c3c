"""Rollouts of a long-tailed workload: the ``reference`` engine (the whole batch decodes
until its longest row stops) vs the ``compact`` engine (one prefill per prompt, a paged KV
cache, finished rows leave the batch), the latter also with at most ``--max-rows`` rows
decoding at once (continuous batching), ``train.rl.rollout.Generator`` every way.

    python benchmarks/rollout.py                  # 16 prompts x G = 8, ~256-token prompts
    python benchmarks/rollout.py --rounds 5 --decode-chunk 32 --page-size 32

The workload: 16 prompts of 224..288 tokens, G = 8 samples each (128 rows), per-row
budgets ``ceil(1024 u^3)`` (u uniform; the mean / longest is about 1/4) with one row at
the longest, 1,024 new tokens; stop tokens off (a row ends at its budget). The model is a
Qwen3-architecture decoder shrunk to run on 2 CPU cores in a few minutes (``--hidden``,
``--layers``, ``--vocab``: 64, 2, 16,384 by default), random weights, float32.

Each engine is compiled and run once first; then ``--rounds`` interleaved rounds (each
engine once per round, same key) and the medians of CPU seconds (this process, user +
system) and wall seconds. Also printed: the work each engine computed
(``models.generate.Work``: prompt tokens prefilled, decode row-steps, the most KV cache
slots allocated at once and their MiB over the layers, keys and values, and the most the
rows held) and the ideal ``Σ
lengths / (B x longest)``, the fraction of the reference's decode work the completions
need. The engines draw the same tokens (checked).

With ``google-tunix`` importable, Tunix 0.1.7's vanilla ``Sampler`` (its own Qwen3 of the
same shapes, random weights; one prompt string per row, as its GRPO learner passes them;
no per-row budgets: every row decodes ``--longest`` tokens, an end token it never draws)
runs in the same rounds.
"""

from __future__ import annotations

import argparse

import checkout  # noqa: F401  (the checkout's packages on sys.path)
import jax
import numpy as np

from harness import bench
from harness.machine import describe
from models import get_config
from models.mesh import make_mesh
from train.rl import rollout, state
from train.rl.placement import Placement

#: name -> (engine, whether ``--max-rows`` caps it)
ENGINES = {"reference": ("reference", False), "compact": ("compact", False),
           "compact, rows at once <= max": ("compact", True)}


def workload(prompts: int, group: int, longest: int, seed: int = 0):
    """``(prompts, budgets [prompts x group])``: prompt lengths 224..288, budgets
    ``ceil(longest u^3)`` with the first row at ``longest``."""
    rng = np.random.default_rng(seed)
    ps = [rng.integers(10, 1000, rng.integers(224, 289)).tolist() for _ in range(prompts)]
    budgets = np.ceil(longest * rng.random(prompts * group) ** 3).astype(np.int32)
    budgets = np.clip(budgets, 1, longest)
    budgets[0] = longest
    return ps, budgets


def tunix_sampler(prompts, group: int, cfg, longest: int):
    """``call() -> None``: Tunix's vanilla ``Sampler`` on the rows (each prompt ``group``
    times), or None when ``google-tunix`` is not importable."""
    try:
        from flax import nnx
        from tunix.generate.sampler import CacheConfig, Sampler
        from tunix.models.qwen3 import model as qwen3
    except ImportError:
        return None
    texts = [f"p{i}" for i in range(len(prompts))]
    ids = dict(zip(texts, prompts, strict=True))
    end = cfg.vocab_size  # never drawn: every row decodes max_generation_steps

    class Tokenizer:
        def encode(self, text, **kwargs):
            return ids[text]

        def decode(self, token_ids, **kwargs):
            return ""

        def bos_id(self):
            return None

        def eos_id(self):
            return end

        def pad_id(self):
            return 0

    tcfg = qwen3.ModelConfig(
        num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size,
        embed_dim=cfg.hidden_size, hidden_dim=cfg.intermediate_size,
        num_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
        num_kv_heads=cfg.num_key_value_heads, rope_theta=cfg.rope_theta, norm_eps=1e-6,
        use_tied_embedding=True)
    width = max(map(len, prompts))
    sampler = Sampler(qwen3.Qwen3(tcfg, rngs=nnx.Rngs(0)), Tokenizer(), CacheConfig(
        cache_size=width + longest + 8, num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim))
    rows = [t for t in texts for _ in range(group)]

    def call():
        out = sampler(rows, max_generation_steps=longest, max_prompt_length=width,
                      temperature=1.0, eos_tokens=[end], seed=1)
        jax.block_until_ready(out.tokens)

    return call


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--longest", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=16_384)
    p.add_argument("--decode-chunk", type=int, default=64)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--max-rows", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)

    cfg = get_config("tiny", dtype="float32", vocab_size=args.vocab, hidden_size=args.hidden,
                     intermediate_size=4 * args.hidden, num_hidden_layers=args.layers,
                     max_position_embeddings=4096)
    mdef = state.ModelDef.of(cfg)
    params = Placement(make_mesh({"data": 1}, devices=jax.devices()[:1]), mdef).init_params(0)
    prompts, budgets = workload(args.prompts, args.group, args.longest)
    gens = {name: rollout.Generator(
        mdef, max_new_tokens=args.longest, stop_ids=(), num_valid=args.vocab, engine=e,
        decode_chunk=args.decode_chunk, page_size=args.page_size,
        max_decode_rows=args.max_rows if capped else 0)
        for name, (e, capped) in ENGINES.items()}
    key = jax.random.key(1)

    def call(engine):
        return gens[engine](params, prompts, key, temperature=1.0, group_size=args.group,
                            max_new_tokens=budgets)

    calls = {e: (lambda e=e: call(e)) for e in ENGINES}
    tunix_call = tunix_sampler(prompts, args.group, cfg, args.longest)
    if tunix_call:
        calls["tunix"] = tunix_call
    times = bench.rounds(calls, args.rounds)  # after a compiling call each
    ref = times["reference"].last
    others = [times[e].last for e in ENGINES if e != "reference"]
    differ = sum(int(np.sum(ref.tokens != got.tokens)) for got in others)
    lp = max(float(np.abs(ref.logprobs - got.logprobs).max()) for got in others)
    med = {e: (t.cpu, t.wall) for e, t in times.items()}
    rows = len(budgets)
    ideal = ref.lengths.sum() / (rows * ref.lengths.max())
    print(describe())
    print(f"{args.prompts} prompts x G = {args.group} ({rows} rows), prompts "
          f"{min(map(len, prompts))}..{max(map(len, prompts))} tokens, budgets mean "
          f"{budgets.mean():.0f} / longest {budgets.max()} (stop tokens off); model hidden "
          f"{args.hidden}, {args.layers} layers, vocab {args.vocab}, float32; decode chunk "
          f"{args.decode_chunk}, page size {args.page_size}, max rows {args.max_rows}; "
          f"medians of {args.rounds} interleaved rounds after a compiling call")
    print(f"same tokens: {differ} of {ref.tokens.size * len(others)} differ; largest "
          f"log-prob difference {lp:.1e}")
    print()
    print("| engine | CPU s | wall s | CPU vs reference | wall vs reference "
          "| compact's CPU vs it | prompt tokens prefilled | decode row-steps "
          "| KV slots allocated | KV MiB | KV slots held |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    names = {"tunix": "Tunix 0.1.7 vanilla Sampler",
             "compact, rows at once <= max": f"compact, <= {args.max_rows} rows at once"}
    width = max(map(len, prompts))
    per_slot = 2 * args.layers * cfg.num_key_value_heads * cfg.head_dim * 4 / 2 ** 20
    for e in times:
        cpu, wall = med[e]
        if e == "tunix":  # every row: prompt padded to the widest, all longest steps
            prefill, steps = rows * width, rows * args.longest
            slots = held = rows * (width + args.longest + 8)  # its CacheConfig
        else:
            work = gens[e].last_work
            prefill, steps = work.prefill_tokens, work.decode_row_steps
            slots, held = work.kv_slots, work.kv_slots_held
        print(f"| {names.get(e, e)} | {cpu:.2f} | {wall:.2f} "
              f"| {cpu / med['reference'][0]:.3f}x | {wall / med['reference'][1]:.3f}x "
              f"| {med['compact'][0] / cpu:.3f}x | {prefill:,} | {steps:,} | {slots:,} "
              f"| {slots * per_slot:.1f} | {held:,} |")
    if not tunix_call:
        print("| Tunix 0.1.7 vanilla Sampler | (google-tunix not importable) "
              "| | | | | | | | | |")
    print()
    print(f"ideal: Σ lengths / (B x longest) = {ideal:.3f}")


if __name__ == "__main__":
    main()
