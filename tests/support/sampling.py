"""What the sampling tests share: the truncation settings and a chi-square check."""

from __future__ import annotations

import numpy as np

TRUNCATIONS = [{}, {"top_p": 0.8}, {"top_k": 50}, {"min_p": 0.05},
               {"top_k": 50, "top_p": 0.9, "min_p": 0.05}]


def chi_square_ok(counts, p, label) -> None:
    """A chi-square goodness-of-fit test of ``counts`` against probabilities ``p``.

    P(chi2 > dof + 5 sqrt(2 dof)) is below 1e-4 for these dof: a wrong sampler (the noise of
    one chunk reused, the temperature ignored, the wrong support) fails by orders of
    magnitude."""
    expected = p * counts.sum()
    big = expected >= 5  # pool the rare ids into one cell
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    chi2 = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    dof = keep.sum() - 1
    assert chi2 < dof + 5 * np.sqrt(2 * dof), (label, chi2, dof)
