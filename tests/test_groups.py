"""Subgroups from dist.new_group: overlapping and disjoint groups (disjoint ones running at
the same time), ranks outside a group skipping it, groups alternating over rounds, global-rank
addressing for broadcast and send/recv inside a group; and sequence numbers that advance by one
per collective, equal on every rank, also for a new group."""
import pytest

from conftest import family_params

GROUP_FAMILIES = [("new_group", 2), ("sequence_numbers", 1)]


@pytest.mark.parametrize("family,world,transport", family_params(GROUP_FAMILIES))
def test_subgroups_and_sequence_numbers(check_runs, family, world, transport):
    check_runs.get(world, transport).assert_family(family)
