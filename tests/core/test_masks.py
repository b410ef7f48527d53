"""Attention masks read by meaning (``accounting.as_mask``): key columns every query masks change nothing."""

from __future__ import annotations

import numpy as np

from tensordiff.diff.accounting import as_mask

Q = 8
CAUSAL = np.triu(np.ones((Q, Q), dtype=bool), 1)  # True = masked


def test_stablelm_s_extra_key_column_masked_for_every_query_is_the_causal_mask():
    additive = np.full((2, 1, Q, Q + 1), np.finfo(np.float32).min, dtype=np.float32)
    for i in range(Q):
        additive[:, :, i, : i + 1] = 0.0
    mask, causal = as_mask(additive), as_mask(CAUSAL[None, None])
    assert mask is not None and causal is not None
    assert mask.attend.shape == (Q, Q) and mask.causal and mask.same_meaning(causal)


def test_bool_masks_with_an_unused_key_column_in_either_polarity():
    masked = np.concatenate([CAUSAL, np.ones((Q, 1), dtype=bool)], axis=-1)  # True = masked, the tail masked
    attend = ~masked
    for x in (masked, attend):
        m = as_mask(x[None, None])
        assert m is not None and m.attend.shape == (Q, Q) and m.causal


def test_keys_of_a_cache_before_the_queries_are_kept():
    """A [Q, P + Q] mask whose queries see P earlier keys: nothing is dropped, the diagonal is at the end."""
    past = 3
    x = np.zeros((Q, past + Q), dtype=np.float32)
    x[:, past:] = np.where(CAUSAL, -1e9, 0.0)
    m = as_mask(x[None, None])
    assert m is not None and m.attend.shape == (Q, past + Q) and m.attend[:, :past].all()
