"""The Proposer/Coder alternation schedule."""

from __future__ import annotations

import pytest

from kz_stream.rl.schedule import AlternationConfig, AlternationSchedule


def test_default_is_twenty_each_four_rounds() -> None:
    sched = AlternationSchedule()
    turns = list(sched)
    assert len(turns) == len(sched) == 160
    assert [t.role for t in turns[:20]] == ["proposer"] * 20
    assert [t.role for t in turns[20:40]] == ["coder"] * 20
    assert (turns[40].role, turns[40].round, turns[40].step_in_turn) == ("proposer", 1, 0)
    last = turns[-1]
    assert (last.step, last.round, last.role, last.step_in_turn) == (159, 3, "coder", 19)
    assert sched.turn_at(160) is None and sched.turn_at(-1) is None


def test_config_driven() -> None:
    cfg = AlternationConfig(proposer_steps=1, coder_steps=2, rounds=2, order=("coder", "proposer"))
    roles = [(t.round, t.role, t.step_in_turn) for t in AlternationSchedule(cfg)]
    assert roles == [
        (0, "coder", 0),
        (0, "coder", 1),
        (0, "proposer", 0),
        (1, "coder", 0),
        (1, "coder", 1),
        (1, "proposer", 0),
    ]


def test_resume_from_step() -> None:
    sched = AlternationSchedule(AlternationConfig(proposer_steps=2, coder_steps=2, rounds=2))
    assert [t.step for t in sched.iter_from(5)] == [5, 6, 7]
    turn = sched.turn_at(5)
    assert turn is not None and (turn.round, turn.role, turn.step_in_turn) == (1, "proposer", 1)


def test_single_role_and_validation() -> None:
    only = AlternationSchedule(AlternationConfig(coder_steps=3, rounds=1, order=("coder",)))
    assert [t.role for t in only] == ["coder"] * 3
    with pytest.raises(ValueError):
        AlternationConfig(order=("coder", "coder"))
    with pytest.raises(ValueError):
        AlternationConfig(rounds=-1)
