"""The one bucket planner (fczero/comm/buckets.py): units join the open bucket whole,
within the cap or under the floor; a unit that cannot join opens buckets of its own."""

from __future__ import annotations

from fczero.comm.buckets import Unit, plan_buckets, plan_items


def test_items_cut_consecutive_equal_keys_within_the_cap_consecutive_equal_keys_within_the_cap():
    items = [("a", 4), ("a", 4), ("a", 4), ("b", 1), (None, 1), ("b", 1), ("b", 10), ("b", 1)]
    assert plan_items(items, 8) == [[0, 1], [2], [3], [4], [5], [6], [7]]
    assert plan_items(items, 100) == [[0, 1, 2], [3], [4], [5, 6, 7]]
    assert plan_items([], 8) == []


def test_a_unit_joins_whole_or_opens_buckets_split_at_the_cap():
    units = [Unit("a", (3, 3)), Unit("a", (2, 2)), Unit("a", (6, 6)), Unit("a", (1,))]
    # 3+3 then the 4 bytes of the second unit fit 10; the third (12) opens a bucket and
    # splits at the cap; the last joins the open piece (6 + 1 <= 10)
    assert plan_buckets(units, 10) == [[0, 1, 2, 3], [4], [5, 6]]


def test_a_unit_that_may_not_join_opens_a_bucket_that_later_units_join():
    units = [Unit("a", (1,)), Unit("a", (1,), joins=False), Unit("a", (1,))]
    assert plan_buckets(units, 100) == [[0], [1, 2]]


def test_a_bucket_under_the_floor_takes_the_next_unit_past_the_cap():
    units = [Unit("a", (2,)), Unit("a", (9,)), Unit("a", (9,))]
    assert plan_buckets(units, 10) == [[0], [1], [2]]
    assert plan_buckets(units, 10, floor=3) == [[0, 1], [2]]  # 2 < 3: takes 9 anyway


def test_keys_never_mix_and_none_never_shares():
    units = [Unit("a", (1,)), Unit("b", (1,)), Unit(None, (1, 1)), Unit(None, (1,))]
    assert plan_buckets(units, 100) == [[0], [1], [2, 3], [4]]
