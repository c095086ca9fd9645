"""A fair claimer's memory of its positions in the keys (tasks/lifecycle/values.py, FairPositions):
one per key and level, the furthest in the key's order, the most recent ``bound`` only."""

from __future__ import annotations

import datetime as dt
import json

from tasks.lifecycle.values import ClaimedTask, ClaimPosition, FairPosition, FairPositions, fair_positions_json

NOW = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)


def row(id: int, key: str | None, *, priority: int = 0, turn: bool = True) -> ClaimedTask:
    at = NOW + dt.timedelta(seconds=id)
    return ClaimedTask(
        id, 1, "p", [], {}, 0, 3, None, NOW, None, "q", priority, NOW, run_after=at, fair_key=key, fair_turn=turn
    )


def test_the_furthest_row_of_each_key_and_level_the_most_recent_keys_only() -> None:
    memory = FairPositions(2)
    memory.remember([row(2, "a"), row(1, "a"), row(3, "b"), row(4, "b", priority=5), row(9, None, turn=False)])
    assert [(p.fair_key, p.priority, p.id) for p in memory.values()] == [("a", 0, 2), ("b", 0, 3), ("b", 5, 4)]
    memory.remember([row(7, "c"), row(8, "a")])  # a moves to the most recent end; b, the oldest, goes
    assert [(p.fair_key, p.priority, p.id) for p in memory.values()] == [("c", 0, 7), ("a", 0, 8)]
    assert all(isinstance(p, FairPosition) for p in memory.values())


def test_the_json_a_claim_takes_is_each_keys_positions_under_its_name() -> None:
    memory = FairPositions(2)
    memory.remember([row(1, 'a "\\ \u00e9'), row(2, "b", priority=-5), row(3, "b", priority=7)])
    memory.remember([row(4, "b", priority=7), row(5, "c")])  # a goes: the least recent of three keys
    at = {n: (NOW + dt.timedelta(seconds=n)).isoformat() for n in (2, 4, 5)}
    expected = {
        "b": [{"priority": -5, "run_after": at[2], "id": 2}, {"priority": 7, "run_after": at[4], "id": 4}],
        "c": [{"priority": 0, "run_after": at[5], "id": 5}],
    }
    assert json.loads(memory.json()) == expected == json.loads(fair_positions_json(memory.values()))
    assert fair_positions_json(memory) == memory.json()
    assert json.loads(fair_positions_json([])) == {}


def test_the_fills_positions_come_from_the_rows_the_fill_took() -> None:
    claimed = [row(5, "a"), row(2, "b", turn=False), row(3, None, turn=False)]
    assert ClaimPosition.last_per_level(claimed) == {("q", 0): ClaimPosition("q", 0, NOW + dt.timedelta(seconds=3), 3)}


def test_revisits_says_whether_the_last_claim_came_back_to_a_remembered_key() -> None:
    memory = FairPositions(2)
    memory.remember([row(1, "a"), row(2, "b")])
    assert not memory.revisits  # nothing remembered before
    memory.remember([row(3, "c"), row(4, "d")])
    assert not memory.revisits  # going round more keys than it keeps: positions would be sent for nothing
    memory.remember([row(5, "d"), row(6, "e")])
    assert memory.revisits
    memory.clear()  # a claim from the front: the positions go, the keys are still known as recent
    assert memory.values() == [] and memory.json() == "{}"
    memory.remember([row(7, "e")])
    assert memory.revisits
    memory.remember([row(8, "f")])
    assert not memory.revisits
