"""Cells: hash tags spread evenly over the slot space, ids carry their cell (pure logic)."""
from __future__ import annotations

from collections import Counter

import pytest
from redis.crc import key_slot as redis_key_slot

from omniflow.storage.cells import (
    CLUSTER_SLOTS,
    cell_for_key,
    cell_limit,
    cell_of,
    cell_tag,
    key_slot,
    new_id,
    radical_inverse,
)
from omniflow.ops.embedded_ha import slot_ranges


def test_key_slot_is_redis_key_slot() -> None:
    for tag in ("c0.1", "abc", "c15.77", "x" * 40):
        assert key_slot(tag) == redis_key_slot(f"of:{{{tag}}}:wf:1".encode())


def test_radical_inverse() -> None:
    assert [radical_inverse(n) for n in range(8)] == [0, .5, .25, .75, .125, .625, .375, .875]


def test_cell_tags_are_stable_distinct_and_spread() -> None:
    assert cell_tag(3) == cell_tag(3)
    tags = [cell_tag(c) for c in range(64)]
    assert len(set(tags)) == 64
    slots = [key_slot(t) for t in tags]
    for power in (2, 4, 8, 16, 32, 64):      # any power of two: exactly even spacing (within the window)
        spaced = sorted(slots[:power])
        gaps = [b - a for a, b in zip(spaced, spaced[1:])]
        assert max(gaps) - min(gaps) < 2 * 16 and spaced[0] < 16
    with pytest.raises(ValueError):
        cell_tag(-1)


@pytest.mark.parametrize("primaries", [3, 4, 5, 6])
def test_sixteen_cells_fill_n_primaries_within_one_and_a_half_shares(primaries: int) -> None:
    ranges = slot_ranges(primaries)
    owner = Counter(next(i for i, (a, b) in enumerate(ranges) if a <= key_slot(cell_tag(c)) <= b) for c in range(16))
    assert len(owner) == primaries
    assert max(owner.values()) / 16 <= 1.5 / primaries


def test_ids_carry_their_cell() -> None:
    assert cell_of(new_id(0)) == 0 and "-" not in new_id(0)
    assert cell_of(new_id(7)) == 7 and new_id(7).startswith("7-")
    assert cell_of("0123abcd") == 0 and cell_of("x-1") == 0 and cell_of("12-ff") == 12


def test_idempotency_cell_is_fixed_by_the_key_and_limits_share_the_total() -> None:
    assert cell_for_key("tenant", "req-1", cells=16) == cell_for_key("tenant", "req-1", cells=16)
    assert len({cell_for_key("t", f"r{i}", cells=16) for i in range(200)}) == 16
    for total, n in ((10_000, 16), (17, 16), (16, 16), (5, 1), (100, 7)):
        limits = [cell_limit(total, n, c) for c in range(n)]
        assert sum(limits) == total and max(limits) - min(limits) <= 1
    assert CLUSTER_SLOTS == 16384
