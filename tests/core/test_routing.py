"""The arithmetic of the routing rule (``diff.routing``): a parameter gradient rebuilt per token from its module's
input and output gradient, the flipped tokens' share taken out, and token indices carried from B's layout to A's.
The rule end to end, on real megatron-core and Hugging Face MoE models: tests/test_families.py."""

from __future__ import annotations

import numpy as np
import pytest

from tensordiff.diff.routing import _rebuild, _Side


class _NoCapture:
    def records(self, step):
        return []


def test_a_linear_gradient_is_rebuilt_as_g_t_x_and_its_rest_leaves_the_flipped_rows_out():
    rng = np.random.default_rng(0)
    x, g = rng.normal(size=(6, 5)), rng.normal(size=(6, 3))
    keep = np.array([True, True, False, True, True, True])
    (full, rest), = _rebuild(np.zeros((3, 5)), x, g, keep)
    np.testing.assert_allclose(full, g.T @ x)
    np.testing.assert_allclose(rest, full - np.outer(g[2], x[2]))


def test_a_norm_weight_gradient_has_bias_rms_and_layernorm_forms_and_the_rms_one_matches_an_rmsnorm():
    rng = np.random.default_rng(1)
    x, g = rng.normal(size=(8, 4)), rng.normal(size=(8, 4))
    keep = np.ones(8, dtype=bool)
    forms = _rebuild(np.zeros(4), x, g, keep)
    assert len(forms) == 3
    xhat = x / np.sqrt(np.mean(x * x, axis=1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(forms[1][0], (g * xhat).sum(axis=0))
    np.testing.assert_allclose(forms[0][0], g.sum(axis=0))


def test_a_parameter_of_no_known_form_has_no_rebuild():
    assert _rebuild(np.zeros((2, 2, 2)), np.ones((4, 2)), np.ones((4, 2)), np.ones(4, dtype=bool)) == []


@pytest.mark.parametrize("transposed", [False, True])
def test_b_tokens_are_carried_to_a_grid_through_a_transposed_layout(transposed):
    # A's grid [S=3, B=2] (megatron); B's [B=2, S=3] (Hugging Face) when transposed
    side = _Side(_NoCapture(), 0, (2, 3) if transposed else (3, 2), transposed)
    got = side.to_a(np.arange(6))
    if not transposed:
        assert got.tolist() == list(range(6))
    else:  # B's token (b, s) = b * 3 + s is A's (s, b) = s * 2 + b
        assert got.tolist() == [s * 2 + b for b in range(2) for s in range(3)]
