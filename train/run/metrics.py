"""Metrics: JSONL + TensorBoard (process 0 only), FLOP counts, MFU and peak memory.

Resume safety: ``MetricsWriter`` reads the steps already in its JSONL file and never
writes a step again, and drops a trailing partial line (a write cut by SIGKILL). A job
resumed from an earlier checkpoint recomputes the steps after it (the same numbers: the
data position and RNG key come from the checkpoint) without duplicating their lines.
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import sys
from pathlib import Path

import jax
import numpy as np

from train.rl import rollout, updates


class MetricsWriter:
    """Append ``{"step": s, **metrics}`` lines to ``path`` and scalars to TensorBoard.

    Args:
      path: the JSONL file (its directory is created). TensorBoard events go to
        ``<path's directory>/tb``.
      enabled: write at all (true on process 0 only).
      tensorboard: also write TensorBoard events.
    """

    def __init__(self, path, *, enabled: bool = True, tensorboard: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        self.written: set[tuple[str, int]] = set()
        self._tb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            raw = self.path.read_bytes()
            complete = raw[: raw.rfind(b"\n") + 1]
            if len(complete) != len(raw):  # a line cut short by a kill
                with open(self.path, "r+b") as f:
                    f.truncate(len(complete))
            for line in complete.decode().splitlines():
                rec = json.loads(line)
                self.written.add((rec.get("kind", "train"), rec["step"]))
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.path.parent / "tb"))

    def write(self, step: int, metrics: dict, kind: str = "train") -> bool:
        """Write one record unless ``(kind, step)`` is already in the file. Numbers are
        written as floats; strings as they are. Returns whether it wrote."""
        if not self.enabled or (kind, step) in self.written:
            return False
        rec = {"kind": kind, "step": int(step)}
        for k, v in metrics.items():
            rec[k] = v if isinstance(v, str) else float(v)
        line = (json.dumps(rec) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write call: a line is either all there or cut at the end
        finally:
            os.close(fd)
        self.written.add((kind, step))
        if self._tb is not None:
            for k, v in rec.items():
                if k not in ("kind", "step") and not isinstance(v, str) and math.isfinite(v):
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
            self._tb.flush()
        return True

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


#: Diagnostics a step with several updates also writes per update, as
#: ``<name>/<epoch>.<mini-batch>`` (``reduce_updates``).
PER_UPDATE = ("clip_fraction", "clip_fraction_low", "clip_fraction_high", "clip_fraction_dual",
              "approx_kl_old", "ratio_mean", "ratio_max", "logprob_diff_mean",
              "logprob_diff_max", "expert_disagreement", "grad_norm")


def reduce_updates(updates: list[tuple[tuple[int, int], dict]]) -> dict[str, float]:
    """The metrics of a step's updates (``train.rl.updates.StepReport.updates``) as one line:
    each metric's mean over the updates (``*_max``: their maximum), and with several
    updates each ``PER_UPDATE`` diagnostic of each update as ``<name>/<epoch>.<mini>``
    (e.g. ``clip_fraction/2.1``: the first mini-batch of the second epoch), as verl and
    TRL report the clip fractions, the KL to the old policy and the ratio per update."""
    line = {}
    for name in updates[0][1]:
        values = [float(m[name]) for _, m in updates]
        line[name] = max(values) if name.endswith("_max") else sum(values) / len(values)
    if len(updates) > 1:
        for (epoch, mini), m in updates:
            line.update({f"{k}/{epoch}.{mini}": float(m[k]) for k in PER_UPDATE if k in m})
    return line


def machine() -> str:
    """What this process computes on, for reports and plot titles: the accelerators' kind
    and count, or the CPU's model name (as ``lscpu`` gives it) and its core count."""
    devices = jax.local_devices()
    if devices[0].platform != "cpu":
        return f"{len(devices)} x {devices[0].device_kind}"
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
    except OSError:
        names = []
    return f"{names[0] if names else platform.machine()}, {os.cpu_count()} cores"


def peak_memory_bytes() -> int:
    """Peak memory: the largest ``peak_bytes_in_use`` of the local accelerators, or on
    CPU (no allocator statistics) the process's peak resident set size."""
    peaks = []
    for d in jax.local_devices():
        stats = d.memory_stats() if hasattr(d, "memory_stats") else None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    if peaks:
        return max(peaks)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def body_flops_per_token(cfg, context: float) -> float:
    """Forward FLOPs of the decoder body per token (no head, no embedding lookup).

    ``2 * (non-embedding matmul parameters per token)`` plus attention
    ``4 * layers * heads * head_dim * context`` (QK^T and PV over ``context`` keys; the
    mean attended length). MoE layers count the ``top-k`` experts and the router only.
    """
    h, n, k, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    attn = h * (n + 2 * k) * d + n * d * h
    total = 0.0
    for layer in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(layer):
            mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
        else:
            mlp = 3 * h * cfg.intermediate_size
        total += 2 * (attn + mlp) + 4 * n * d * context
    return total


def head_flops_per_token(cfg) -> float:
    """Forward FLOPs of the LM head per computed token: ``2 * H * V``."""
    return 2.0 * cfg.hidden_size * cfg.vocab_size


def train_step_flops(cfg, num_tokens: int, head_tokens: int, context: float) -> float:
    """Model FLOPs of one training step (forward + backward, no rematerialisation
    counted): ``3 * body * num_tokens + 3 * head * head_tokens``, the usual "backward is
    twice the forward" rule (Kaplan et al. 2020; PaLM's MFU, Chowdhery et al. 2022,
    appendix B). ``head_tokens`` is what the head computes (the bucket with skipping, all
    tokens without); the head's backward recompute of the logits is hardware work, not
    model FLOPs, and is not counted."""
    return 3.0 * (body_flops_per_token(cfg, context) * num_tokens
                  + head_flops_per_token(cfg) * head_tokens)


#: Dense peak FLOP/s per device by ``device_kind`` substring (bf16; vendor data sheets).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "TPU v5p": 459e12,
              "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v4": 275e12, "TPU v6": 918e12}


def peak_flops(override: float = 0.0) -> float:
    """Peak FLOP/s of all local devices: ``override`` if > 0, else ``PEAK_FLOPS`` by
    device kind, else for a CPU ``cores * 2.5e9 Hz * 32`` (two 8-wide float32 FMA units
    per core, AVX2)."""
    if override > 0:
        return override
    devices = jax.local_devices()
    kind = devices[0].device_kind
    for name, value in PEAK_FLOPS.items():
        if name.lower() in kind.lower():
            return value * len(devices)
    return (os.cpu_count() or 1) * 2.5e9 * 32


def truncated_mass_mean(ro: rollout.Rollout) -> float:
    """Mean over the rollout's completion tokens of the probability mass the truncation
    left out (``1 - exp(logmass)``; 0 when untruncated)."""
    live = np.arange(ro.tokens.shape[1])[None, :] < ro.lengths[:, None]
    return float(-np.expm1(ro.logmass[live]).mean()) if live.any() else 0.0


def grpo_metrics(report: updates.StepReport, rewards: np.ndarray, correct: np.ndarray,
                 ro: rollout.Rollout, *, epochs: int, times: dict, flops: float,
                 peak: float) -> dict:
    """The metrics line of one GRPO step (besides the loop's ``lr``, ``skipped_prompts``,
    ``peak_memory_bytes``).

    Args:
      report: the step's updates (``train.rl.updates.StepReport``: loss, KL, clip fractions,
        ... per update, reduced by ``reduce_updates``; the batches' sizes).
      rewards, correct: ``[P, G]`` (``train.run.experience.score``).
      ro: the rollout.
      epochs: passes over the rollout (``train.updates_per_batch``).
      times: seconds of ``rollout`` (sampling and scoring), ``reference`` (advantages,
        packing and the forwards before the first update), ``train`` (the updates).
      flops: model FLOPs of the updates (``train_step_flops`` per epoch).
      peak: peak FLOP/s of the local devices.
    """
    total = report.positions
    seconds = sum(times.values())
    return {
        **reduce_updates(report.updates),
        "reward_mean": rewards.mean(), "reward_std": rewards.std(),
        "accuracy": correct.mean(),
        "zero_std_group_fraction": float(np.mean(rewards.std(axis=1) == 0)),
        "completion_length_mean": float(ro.lengths.mean()),
        "completion_length_max": float(ro.lengths.max()),
        "stop_fraction": float(ro.stopped.mean()),
        "lm_head_token_fraction": report.kept / total,
        "lm_head_bucket_fraction": report.head_tokens / total,
        "tokens_per_s": report.real / seconds,
        "train_tokens_per_s": report.real * epochs / times["train"],
        "mfu": flops / times["train"] / peak,
        "time_rollout_s": times["rollout"], "time_reference_s": times["reference"],
        "time_train_s": times["train"], "sampling_path": ro.path,
        "truncated_mass_mean": truncated_mass_mean(ro),
    }
