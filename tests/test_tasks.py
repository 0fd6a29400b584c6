"""worker.tasks' shared score activations, against the plain formulas in float64."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from worker.tasks import activate, sigmoid


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_sigmoid_is_the_formula_in_the_logits_type_and_never_overflows(dtype: type) -> None:
    logits = np.array([-1e6, -1000.0, -120.0, -88.0, -20.0, -1.5, 0.0, 0.7, 30.0, 1e6], dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow in exp is a RuntimeWarning
        got = sigmoid(logits)
    assert got.dtype == dtype
    plain = 1 / (1 + np.exp(-np.maximum(logits.astype(np.float64), -700)))
    # within 1e-30 where the floor (-88 in float32, -709 in float64) cuts in: no threshold tells them apart
    assert np.allclose(got, plain, rtol=1e-6, atol=1e-30)
    assert np.all(np.diff(got) >= 0) and got[0] > 0 and got[-1] == 1  # monotone; none exactly 0


def test_activate_softmax_sums_to_one_along_its_axis_and_none_leaves_scores_as_they_are() -> None:
    scores = np.array([[1.0, 2.0, 3.0], [1000.0, 0.0, -1000.0]])
    probs = activate(scores, "softmax", axis=1)
    assert np.allclose(probs.sum(axis=1), 1) and np.allclose(probs[0], np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum())
    assert probs[1, 0] == 1.0  # no overflow from the large logit
    assert activate(scores, "none") is scores and activate(scores, None) is scores
    assert np.allclose(activate(scores[:1], "sigmoid"), 1 / (1 + np.exp(-scores[:1])))
