"""DAPO's overlong handling (services/algorithms/overlong.py) on hand values."""

import pytest

from services.algorithms.overlong import overlong_penalty, truncated


@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (12, 0.0),  # L_max - L_cache = 16 - 4 = 12: no penalty up to there
        (13, -0.25),  # (12 - 13) / 4 = -0.25
        (14, -0.5),
        (16, -1.0),  # at L_max: the whole penalty
        (17, -1.0),  # beyond L_max (a generator that overran): the whole penalty
    ],
)
def test_soft_overlong_punishment_is_linear_over_the_buffer(length, expected):
    assert overlong_penalty(length, max_length=16, buffer=4, penalty=1.0) == pytest.approx(expected)


def test_the_penalty_factor_scales_it():
    assert overlong_penalty(14, max_length=16, buffer=4, penalty=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(16, max_length=16, buffer=16, penalty=2.0) == pytest.approx(-2.0)  # buffer = L_max
    assert overlong_penalty(8, max_length=16, buffer=16, penalty=2.0) == pytest.approx(-1.0)


@pytest.mark.parametrize("buffer, penalty, message", [(0, 1.0, "buffer"), (17, 1.0, "buffer"), (4, -1.0, "penalty")])
def test_bad_settings_are_refused(buffer, penalty, message):
    with pytest.raises(ValueError, match=message):
        overlong_penalty(10, max_length=16, buffer=buffer, penalty=penalty)


def test_only_a_length_stop_is_a_truncation():
    assert truncated("length") and not truncated("stop") and not truncated("abort")
