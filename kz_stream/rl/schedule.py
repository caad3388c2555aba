"""The alternation schedule: Proposer and Coder train in turns.

Paper default: 20 steps each, 4 rounds. A round is one turn per role in ``order``.
``turn_at(step)`` maps a global step count back to its turn, so a restarted learner resumes
the schedule where it stopped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from kz_stream.events import Role

__all__ = ["AlternationConfig", "AlternationSchedule", "Role", "Turn"]


@dataclass(frozen=True, slots=True)
class AlternationConfig:
    """How many steps each role trains per turn, how many rounds, and who goes first."""

    proposer_steps: int = 20
    coder_steps: int = 20
    rounds: int = 4
    # The Proposer goes first: its reward needs only the Coder's current correctness, which
    # the first Coder samples provide, while the Coder trains best on frontier modules.
    order: tuple[Role, ...] = ("proposer", "coder")

    def __post_init__(self) -> None:
        if self.rounds < 0 or self.proposer_steps < 0 or self.coder_steps < 0:
            raise ValueError("rounds and steps must not be negative")
        if not self.order or len(set(self.order)) != len(self.order):
            raise ValueError(f"order: {self.order} must list each role at most once")

    def steps_for(self, role: Role) -> int:
        return self.proposer_steps if role == "proposer" else self.coder_steps


@dataclass(frozen=True, slots=True)
class Turn:
    """One training step's place in the schedule."""

    step: int  # global, from 0
    round: int  # from 0
    role: Role
    step_in_turn: int  # from 0


class AlternationSchedule:
    """Iterates the steps of the alternation, one ``Turn`` per training step."""

    def __init__(self, config: AlternationConfig | None = None) -> None:
        self.config = config or AlternationConfig()

    @property
    def steps_per_round(self) -> int:
        return sum(self.config.steps_for(r) for r in self.config.order)

    def __len__(self) -> int:
        return self.steps_per_round * self.config.rounds

    def __iter__(self) -> Iterator[Turn]:
        return self.iter_from(0)

    def iter_from(self, step: int) -> Iterator[Turn]:
        """Yields the turns from global step ``step`` (for resuming) to the end."""
        for s in range(max(step, 0), len(self)):
            turn = self.turn_at(s)
            assert turn is not None  # s < len(self)
            yield turn

    def turn_at(self, step: int) -> Turn | None:
        """Returns the turn of global step ``step``, or None once the schedule is over."""
        if step < 0 or step >= len(self):
            return None
        rnd, offset = divmod(step, self.steps_per_round)
        for role in self.config.order:
            n = self.config.steps_for(role)
            if offset < n:
                return Turn(step=step, round=rnd, role=role, step_in_turn=offset)
            offset -= n
        raise AssertionError("unreachable: offset < steps_per_round")
