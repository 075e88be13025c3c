"""docs/layout.md's "How to add a loss variant", done as it says in a temporary copy of
``train/``: one more name in ``train/rl/rl_loss.py``'s ``AGGREGATIONS`` and its branch in
``aggregate`` (a trivial ``"token-sum"``: the plain sum over the completion tokens) is all
it takes for the config check to accept ``loss.aggregation="token-sum"`` (its domain is
built from the tuple), for its error to list it, and for ``grpo_loss`` to use it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np

from tests.support import ROOT

#: What the subprocess runs against the copy: the config check, the error's wording, and the
#: loss with the new aggregation.
SCRIPT = """
import json
import jax.numpy as jnp
import numpy as np
import train
from train.rl import rl_loss
from train.run.schema import base_config, check

cfg = base_config()
cfg.loss.aggregation = "token-sum"
accepted = check(cfg)
cfg.loss.aggregation = "token-max"
refused = check(cfg)
rng = np.random.default_rng(0)
logp = jnp.asarray(rng.normal(-1.0, 0.3, (3, 5)), jnp.float32)
mask = jnp.asarray(rng.random((3, 5)) < 0.7, jnp.float32)
seq_index = jnp.asarray(np.repeat(np.arange(3)[:, None], 5, axis=1), jnp.int32)
advantages = jnp.asarray(np.repeat(rng.normal(size=(3, 1)), 5, axis=1), jnp.float32)
loss_cfg = rl_loss.LossConfig(aggregation="token-sum", max_completion_len=5).check()
loss, _ = rl_loss.grpo_loss(loss_cfg, logp, logp, advantages, mask, seq_index, 3)
print(json.dumps({"package": train.__file__, "accepted": accepted, "refused": refused,
                  "loss": float(loss), "advantages": np.asarray(advantages).tolist(),
                  "mask": np.asarray(mask).tolist()}))
"""


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, old
    return text.replace(old, new)


def test_a_loss_variant_is_one_place(tmp_path):
    copy = tmp_path / "train"
    shutil.copytree(ROOT / "train", copy, ignore=shutil.ignore_patterns("__pycache__"))
    module = copy / "rl" / "rl_loss.py"
    text = _replace_once(
        module.read_text(),
        'AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")',
        'AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm", '
        '"token-sum")')
    text = _replace_once(
        text, '    if mode == "token-mean":\n',
        '    if mode == "token-sum":\n        return x.sum()\n    if mode == "token-mean":\n')
    module.write_text(text)
    env = {"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin",
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.splitlines()[-1])
    assert r["package"].startswith(str(copy)), r["package"]  # the copy, not the checkout
    assert r["accepted"] == []
    assert r["refused"] == [("loss.aggregation = 'token-max': must be one of 'token-mean', "
                             "'seq-mean-token-mean', 'seq-mean-token-sum-norm', 'token-sum'")]
    # on-policy (ratio 1): the loss is -sum of the kept tokens' advantages
    expected = -np.sum(np.asarray(r["advantages"]) * np.asarray(r["mask"]))
    np.testing.assert_allclose(r["loss"], expected, rtol=1e-6)
