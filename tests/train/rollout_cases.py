"""Multi-device cases of the sharded rollouts (``train.rl.rollout.Generator`` under a
``train.rl.placement.Placement``), run by ``tests.support.multidevice`` in subprocesses with
several CPU devices (``tests/train/test_sharded_rollout.py``)."""

from __future__ import annotations

import os
import re

import jax
import numpy as np

from models import get_config
from models.mesh import make_mesh
from tests.support.models import random_model
from train.rl import rollout, state
from train.rl.placement import Placement
from train.run.distributed import initialize_distributed

#: The mesh of the multi-process case: 4 devices, the batch over fsdp x expert.
ROLLOUT_MESH = {"fsdp": 2, "expert": 2}
#: The mesh of the compiled-decoder case: 8 devices, 2 of the 8 experts per device.
DECODE_MESH = {"fsdp": 2, "expert": 4}
STOPS = (7, 11, 13, 17)
MAX_NEW = 8
#: (name, temperature) of the compared calls (one compiled decoder serves both).
CALLS = (("greedy", 0.0), ("sampled", 1.0))


def _policy():
    """The random tiny MoE (8 experts, top-2) with one layer: half the compile time."""
    model = random_model(get_config("tiny-moe", dtype="float32", num_hidden_layers=1), seed=3)
    return state.ModelDef.of(model.cfg), jax.device_get(state.params_of(model))


def _prompts(groups: int, group_size: int = 2) -> list[list[int]]:
    """``groups * group_size`` rows (each prompt repeated ``group_size`` times, as GRPO
    does) of random lengths."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(20, 500, rng.integers(3, 14)).tolist() for _ in range(groups)]
    return [p for p in prompts for _ in range(group_size)]


def _generator(mdef, placement, **kw) -> rollout.Generator:
    kw = {"page_size": 4, **kw}  # prompts of 3-13 tokens take several pages
    return rollout.Generator(mdef, max_new_tokens=MAX_NEW, stop_ids=STOPS, num_valid=500,
                             placement=placement, **kw)


def _rollouts(mdef, params, placement) -> dict:
    """Every ``CALLS`` entry's rollout of 6 rows (3 prompts x 2) as JSON-able lists."""
    gen = _generator(mdef, placement)
    if placement is not None:
        params = placement.place_params(params)
    out = {}
    for name, temperature in CALLS:
        ro = gen(params, _prompts(3), jax.random.key(5), temperature=temperature)
        out[name] = {"tokens": ro.tokens.tolist(), "logprobs": ro.logprobs.tolist(),
                     "min_logit": ro.min_logit.tolist(), "lengths": ro.lengths.tolist(),
                     "stopped": ro.stopped.tolist(), "path": ro.path}
    if placement is not None:
        out["params_kept"] = all(params[k].sharding == placement.params[k] for k in params)
    return out


def sharded_rollout_case() -> dict:
    """The rollouts of ``CALLS`` on the tiny MoE under ``ROLLOUT_MESH`` (4 devices), as 2
    processes x 2 devices (``jax.distributed`` from the environment) or 1 process x 4
    devices; one process also decodes on a single device (``one_device``)."""
    if "JAX_NUM_PROCESSES" in os.environ:
        initialize_distributed()
    mdef, params = _policy()
    out = {"processes": jax.process_count(), "devices": jax.device_count(),
           "mesh": _rollouts(mdef, params, Placement(make_mesh(ROLLOUT_MESH), mdef))}
    if jax.process_count() == 1:
        out["one_device"] = _rollouts(mdef, params, None)
    return out


_SHAPE = re.compile(r"\b[a-z]+\d*\[(\d+),(\d+),(\d+)\]")


def expert_gathers(hlo: str, cfg, local_experts: int, fsdp: int) -> dict[str, list[str]]:
    """The all-gathers of expert weights in compiled HLO text, by kind.

    An all-gather touches an expert weight when a 3-D shape on its line (result or
    operand, metadata cut off) ends in the trailing dimensions of a ``[E, H, I]`` /
    ``[E, I, H]`` projection, whole or split over ``fsdp`` on H. ``own``: leading
    dimension ``local_experts`` (this device's experts, gathered over fsdp: allowed);
    ``foreign``: a larger one (a device gathers other devices' experts).
    """
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    trailing = {(hh, i) for hh in (h, h // fsdp)} | {(i, hh) for hh in (h, h // fsdp)}
    out: dict[str, list[str]] = {"own": [], "foreign": []}
    for line in hlo.splitlines():
        if not re.search(r"\ball-gather(-start)?\(", line):
            continue
        head = line.split("), ")[0]
        shapes = [tuple(map(int, m)) for m in _SHAPE.findall(head)]
        lead = [s[0] for s in shapes if s[1:] in trailing]
        if lead:
            kind = "foreign" if max(lead) > local_experts else "own"
            out[kind].append(head.strip()[:200])
    return out


def decode_collectives_case() -> dict:
    """The compiled decoder of the tiny MoE on ``DECODE_MESH`` (8 devices, 16 rows): its
    expert all-gathers and whether its KV cache is split along the batch; and, the
    control that ``expert_gathers`` finds foreign gathers, the same check on a compiled
    function that replicates the sharded expert weights."""
    mdef, params = _policy()
    placement = Placement(make_mesh(DECODE_MESH), mdef)
    params = placement.place_params(params)
    cfg = mdef.cfg
    local = cfg.num_experts // DECODE_MESH["expert"]
    prompts = _prompts(8)
    width = rollout.pad_prompts(prompts)[0].shape[1]

    gen = _generator(mdef, placement, engine="reference")
    hlo = gen.lower(params, prompts, jax.random.key(0), temperature=1.0).compile().as_text()

    def cache(rows):  # a [rows, L, K, D] KV-cache buffer in the compiled program
        return f"[{rows},{width + MAX_NEW},{cfg.num_key_value_heads},{cfg.head_dim}]" in hlo

    experts = {k: v for k, v in params.items() if k.endswith(("gate_proj", "up_proj",
                                                               "down_proj")) and v.ndim == 3}
    replicate = jax.jit(lambda w: jax.tree.map(lambda x: x * 2, w),
                        out_shardings=placement.replicated)
    control = replicate.lower(experts).compile().as_text()
    return {**expert_gathers(hlo, cfg, local, DECODE_MESH["fsdp"]),
            "cache_per_device": cache(len(prompts) // 8), "cache_whole": cache(len(prompts)),
            "control": expert_gathers(control, cfg, local, DECODE_MESH["fsdp"]),
            "experts": len(experts), "local_experts": local}


def compact_vs_reference_case() -> dict:
    """The ``compact`` engine on ``DECODE_MESH`` (8 devices; rows over fsdp x expert) and
    the ``reference`` engine on one device, same key: 4 prompts of uneven lengths x G = 4,
    per-row budgets and frequent stop ids, pages of 4 slots and at most 8 rows decoding
    at once (one per device: the others wait for a place), untruncated, truncated and
    greedy."""
    mdef, params = _policy()
    rng = np.random.default_rng(12)
    prompts = [rng.integers(20, 500, n).tolist() for n in (3, 12, 5, 9)]
    budgets = rng.integers(1, MAX_NEW + 1, 16)
    stops = tuple(range(0, 500, 12))
    placement = Placement(make_mesh(DECODE_MESH), mdef)
    kw = {"max_new_tokens": MAX_NEW, "stop_ids": stops, "num_valid": 500}
    engines = {"compact": (rollout.Generator(mdef, placement=placement, decode_chunk=2,
                                            page_size=4, max_decode_rows=8, **kw),
                           placement.place_params(params)),
               "reference": (rollout.Generator(mdef, engine="reference", **kw), params)}
    out = {}
    for engine, (gen, p) in engines.items():
        for name, temperature, trunc in (("sampled", 1.0, None), ("greedy", 0.0, None),
                                         ("truncated", 0.8, rollout.Truncation(30, 0.9))):
            ro = gen(p, prompts, jax.random.key(6), temperature=temperature, truncation=trunc,
                     group_size=4, max_new_tokens=budgets)
            out[f"{engine} {name}"] = {
                "tokens": ro.tokens.tolist(), "logprobs": ro.logprobs.tolist(),
                "logmass": ro.logmass.tolist(), "lengths": ro.lengths.tolist(),
                "stopped": ro.stopped.tolist(), "work": list(gen.last_work)}
    return out
