"""The bench's one Zipf law (bench/zipf.py): the weights it promises, and the same draws for the same seed."""

from __future__ import annotations

import numpy as np
import pytest

from bench.zipf import Zipf


def test_weights_follow_one_over_rank_to_the_s() -> None:
    law = Zipf(4, 1.0)
    harmonic = 1 + 1 / 2 + 1 / 3 + 1 / 4
    assert law.weights == pytest.approx([1 / harmonic, 1 / 2 / harmonic, 1 / 3 / harmonic, 1 / 4 / harmonic])
    assert law.share(2) == pytest.approx(1.5 / harmonic)
    assert Zipf(10, 0.0).weights == pytest.approx([0.1] * 10)  # s = 0: uniform


def test_draws_are_the_seeds_and_follow_the_weights() -> None:
    law = Zipf(20, 1.2)
    first = law.draw(np.random.default_rng(7), 20_000)
    assert np.array_equal(first, law.draw(np.random.default_rng(7), 20_000))
    counts = np.bincount(first, minlength=20) / len(first)
    assert counts == pytest.approx(law.weights, abs=0.01)
    one = law.draw(np.random.default_rng(7))
    assert isinstance(one, int) and one == first[0]


def test_requests_rank_the_ids_at_random_and_keep_to_them() -> None:
    ids = [f"m{i}" for i in range(30)]
    picks = Zipf(30, 1.0).requests(np.random.default_rng(3), ids, 5000)
    assert set(picks) <= set(ids)
    # the most requested id differs from seed to seed: the ranking is drawn, not the order of ids
    tops = set()
    for seed in range(8):
        drawn = Zipf(30, 1.0).requests(np.random.default_rng(seed), ids, 2000)
        tops.add(max(set(drawn), key=drawn.count))
    assert len(tops) > 1
    with pytest.raises(ValueError, match="given 2 ids"):
        Zipf(3, 1.0).requests(np.random.default_rng(0), ["a", "b"], 1)
