"""probe.analysis.fit.startup: the start-up's objects frozen out of later collections, and the
collector back on, only where the start-up turned it off."""

from __future__ import annotations

import gc

from probe.analysis.fit.startup import begin, end


def _in_a_generation(objects: list) -> list[bool]:
    """Whether each object is in one of the collector's generations (a frozen one is in none)."""
    ids = {id(o) for generation in range(3) for o in gc.get_objects(generation)}
    return [id(o) in ids for o in objects]


def test_end_freezes_what_the_start_up_made_and_turns_the_collector_back_on():
    was_on, frozen_before = gc.isenabled(), gc.get_freeze_count()
    begin()
    try:
        assert not gc.isenabled()
        made = [[i] for i in range(3)]  # (lists: objects the collector tracks)
        end()
        assert gc.isenabled()
        assert all(gc.is_tracked(m) for m in made)
        assert _in_a_generation(made) == [False] * 3
        assert gc.get_freeze_count() >= frozen_before + len(made)
    finally:
        gc.unfreeze()
        if not was_on:
            gc.disable()


def test_end_leaves_a_collector_it_did_not_turn_off_alone():
    assert gc.isenabled()  # (pytest's process: the collector on)
    frozen_before = gc.get_freeze_count()
    made = [[i] for i in range(3)]
    end()
    assert gc.isenabled() and gc.get_freeze_count() == frozen_before
    assert _in_a_generation(made) == [True] * 3
