"""Dynamic sampling's group filter (services/algorithms/group_filter.py) on hand values."""

import pytest

from services.algorithms.group_filter import keeps_group, reward_std


def test_reward_std_by_hand():
    assert reward_std([1.0, 3.0]) == pytest.approx(1.0)  # mean 2, deviations +-1
    assert reward_std([0.0, 0.0, 3.0]) == pytest.approx(2**0.5)  # mean 1, (1 + 1 + 4) / 3 = 2
    assert reward_std([5.0]) == 0.0 and reward_std([]) == 0.0


@pytest.mark.parametrize(
    "rewards, spec, kept",
    [
        ([1.0, 1.0, 1.0], "none", True),
        ([1.0, 1.0, 1.0], "zero_variance", False),
        ([0.0, 0.0, 0.0, 0.0], "zero_variance", False),
        ([0.0, 0.0, 0.0, 1.0], "zero_variance", True),
        ([0.5], "zero_variance", True),  # one sample: nothing to compare
        ([1.0, 3.0], "std_below:1.0", True),  # std 1.0 is not below 1.0
        ([1.0, 3.0], "std_below:1.01", False),
        ([0.0, 0.0, 3.0], "std_below:1.5", False),  # std 1.414
        ([0.0, 0.0, 3.0], "std_below:1e-3", True),
        ([0.2, 0.2], "std_below:.5", False),
    ],
)
def test_keeps_group(rewards, spec, kept):
    assert keeps_group(rewards, spec) is kept


@pytest.mark.parametrize("spec", ["zero", "std_below:", "std_below:-1", "std_below:0", "std_below:x", ""])
def test_bad_specs_are_refused_naming_the_forms(spec):
    with pytest.raises(ValueError, match="filter_groups"):
        keeps_group([1.0, 2.0], spec)
