"""``sampling``: the draw of Tunix's vanilla sampler on jaxhead.

Tunix 0.1.7's ``tunix.generate.sampler.Sampler`` (``rollout_engine="vanilla"``) draws each
token in ``top_p`` mode (any ``top_p`` set, ``1.0`` included) with the module function
``tunix.generate.sampler.sample_top_p``: ``jax.random.categorical`` over the tempered
``[B, V]`` logits, one Gumbel variate per vocabulary id, after a sort of the row when
``top_k`` / ``top_p`` truncate. At V = 151,936 that noise costs most of a decode step on a
CPU (0.9 CPU s per ``[128, V]`` step on a 2-core machine, against 0.1 s for the logits'
matmul). The sampler takes no sampling function, so this module replaces that one
attribute, restored on exit, with ``jaxhead.sample_from_logits``: the same distribution by
the two-level draw (one Gumbel variate per block of 128 ids and one uniform per row), the
same truncation (top-k, then the nucleus inside it), and the same returned log-probs
(under the tempered, untruncated softmax, as Tunix's). The ``[B, V]`` logits stay: Tunix's
model computes them in its decode step, outside any hook.

What differs from Tunix's draw: the noise (another random stream, so other tokens from the
same seed, drawn from the same distribution); at the edge of a truncated support: ids tied
with the last one kept are kept (Tunix's ``lax.top_k`` keeps exactly k, its nucleus cuts
through ties), and the nucleus is the smallest set whose mass reaches ``top_p`` (Tunix keeps
each id whose preceding mass is at most ``top_p``, one more id where that mass is exactly
``top_p``); with bf16 compute, whose logits take few distinct values, ties are common and a
truncated support can be a few ids larger than Tunix's. Settings Tunix accepts are mapped:
``top_p >= 1`` is untruncated, ``top_p <= 0`` keeps the most likely id(s) (Tunix: the
first of them). ``temperature = 0`` in ``top_p`` mode draws the arg-max and returns its
log-prob at temperature 1 (Tunix divides by 0: NaN). Greedy mode (``top_p=None``,
``sample_best``: an arg-max, no noise) and beam search are Tunix's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tunix.generate import sampler as tunix_sampler

from jaxhead._src.sampling import sample_from_logits
from jaxhead.integrations.tunix.patching import replaced


def _jaxhead_sample_top_p(original):
    """``sample_top_p``'s signature, drawn by ``jaxhead.sample_from_logits``."""

    def sample_top_p(logits, key, temperature, top_p, top_k, return_logprobs=False):
        top_k = 0 if top_k is None or top_k <= 0 else int(top_k)
        if top_p is None or top_p >= 1:
            top_p = 1.0
        elif top_p <= 0:  # Tunix's nucleus then keeps only its most likely id
            top_p, top_k = 1.0, 1
        out = sample_from_logits(logits[:, -1], key, temperature=temperature, top_p=top_p,
                                 top_k=top_k)
        # Tunix returns the log-prob under the whole tempered softmax
        return out.tokens, (out.logprobs + out.logmass) if return_logprobs else None

    sample_top_p.original = original
    return sample_top_p


@contextlib.contextmanager
def sampling() -> Iterator[None]:
    """Inside the block, Tunix's vanilla sampler draws its ``top_p``-mode tokens with
    ``jaxhead.sample_from_logits`` (``tunix.generate.sampler.sample_top_p`` is replaced;
    see the module docstring for what differs). Restored on exit, errors included; blocks
    nest. The sampler looks the function up when it traces its prefill and decode steps,
    and each traced variant (shapes, temperature, ``top_p``, ``top_k``) keeps the draw it
    was traced with: a ``Sampler`` called before the block with the same settings keeps
    Tunix's draw inside it, and one called inside keeps jaxhead's after it for those
    settings. Build and first call the sampler inside the block (a learner trained inside
    it does). Not thread-safe while entering or leaving."""
    with replaced(tunix_sampler, "sample_top_p", _jaxhead_sample_top_p):
        yield
