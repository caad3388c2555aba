"""The reward, gate, advantage, proposer and staleness formulas against hand-computed values."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kz_stream.rl.rewards import (
    RewardConfig,
    ca_grpo_rewards,
    filter_stale,
    group_accuracy,
    group_advantages,
    group_gate,
    proposer_reward,
    speed_term,
    staleness_stats,
)


class TestSpeedTerm:
    @pytest.mark.parametrize(
        ("speedup", "ci", "expected"),
        [
            (2.2, (2.0, 2.5), 1.0),  # the lower bound, not the point estimate, is paid
            (0.55, (0.5, 0.6), -1.0),
            (1.0, (1.0, 1.1), 0.0),
            (9.0, (8.0, 9.5), 2.0),  # log2(8) = 3, clipped to 2
            (0.3, (0.25, 0.4), -1.0),  # log2(0.25) = -2, clipped to -1
            (1.2, (0.9, 1.5), -0.15200309344504997),  # noisy parity: a small penalty
            (4.0, None, 2.0),  # no interval: the point estimate stands in
            (None, None, 0.0),  # not timed: neither reward nor penalty
            (0.0, (0.0, 0.1), -1.0),  # broken measurement: the floor
        ],
    )
    def test_log2_ci_low(
        self, speedup: float | None, ci: tuple[float, float] | None, expected: float
    ) -> None:
        assert speed_term(speedup, ci) == pytest.approx(expected)

    def test_alternatives(self) -> None:
        point = RewardConfig(speed_term="log2_point")
        assert speed_term(2.0, (0.5, 3.0), point) == pytest.approx(1.0)
        linear = RewardConfig(speed_term="linear_ci_low")
        assert speed_term(1.8, (1.5, 2.0), linear) == pytest.approx(0.5)
        assert speed_term(5.0, (4.0, 6.0), linear) == pytest.approx(2.0)  # 3, clipped
        assert speed_term(0.2, (0.1, 0.3), linear) == pytest.approx(-0.9)
        assert speed_term(8.0, (8.0, 9.0), RewardConfig(speed_term="none")) == 0.0

    def test_custom_clip(self) -> None:
        cfg = RewardConfig(speed_clip=(-0.5, 0.5))
        assert speed_term(8.0, (8.0, 9.0), cfg) == 0.5
        assert speed_term(0.1, (0.1, 0.2), cfg) == -0.5


class TestGate:
    def test_accuracy(self) -> None:
        assert group_accuracy([True, False, True, True]) == 0.75
        assert group_accuracy([]) == 0.0

    @pytest.mark.parametrize(
        ("correct", "alpha", "expected"),
        [
            ([True, False], 0.5, True),  # exactly alpha opens the gate
            ([True, False, False], 0.5, False),
            ([True, True, True, False], 0.75, True),
            ([False, False], 0.0, True),
            ([], 0.5, False),
        ],
    )
    def test_gate(self, correct: list[bool], alpha: float, expected: bool) -> None:
        assert group_gate(correct, alpha) is expected


class TestCaGrpoRewards:
    def test_gate_open_pays_speed(self) -> None:
        # accuracy 3/4 >= 0.5: r = 1 + 0.1 * S with S = clip(log2(ci_low), -1, 2)
        rewards = ca_grpo_rewards(
            [True, True, False, True],
            [2.1, 0.6, 3.0, 9.0],
            [(2.0, 2.2), (0.5, 0.7), (2.9, 3.1), (8.0, 10.0)],
        )
        assert rewards == pytest.approx([1.1, 0.9, 0.0, 1.2])

    def test_gate_closed_pays_correctness_only(self) -> None:
        # accuracy 1/4 < 0.5: T(G) = 0, so a fast correct kernel earns exactly 1
        rewards = ca_grpo_rewards(
            [True, False, False, False], [8.0, 1.0, 1.0, 1.0], [(8.0, 9.0), None, None, None]
        )
        assert rewards == [1.0, 0.0, 0.0, 0.0]

    def test_alpha_and_beta(self) -> None:
        cfg = RewardConfig(alpha=0.25, beta=0.5)
        rewards = ca_grpo_rewards([True, False, False, False], [2.0] * 4, [(2.0, 2.0)] * 4, cfg)
        assert rewards == pytest.approx([1.5, 0.0, 0.0, 0.0])

    def test_correct_always_beats_incorrect(self) -> None:
        rewards = ca_grpo_rewards([True, True], [0.01, 1.0], [(0.01, 0.02), (1.0, 1.0)])
        assert min(rewards) == pytest.approx(0.9) and min(rewards) > 0.0

    def test_length_mismatch(self) -> None:
        with pytest.raises(ValueError, match="length"):
            ca_grpo_rewards([True], [1.0, 2.0], [None])

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"beta": 1.0},  # 1 + 1.0 * -1 = 0: correct would tie incorrect
            {"alpha": 1.5},
            {"beta": -0.1},
            {"speed_clip": (1.0, -1.0)},
            {"invalid_module_reward": 0.0},
        ],
    )
    def test_config_rejects(self, kwargs: dict[str, object]) -> None:
        with pytest.raises(ValueError):
            RewardConfig(**kwargs)  # type: ignore[arg-type]


class TestAdvantages:
    def test_hand_computed(self) -> None:
        # mean 0.8; deviations .3 .1 -.8 .4; sample var .9/3 = .3; std .5477225575
        adv = group_advantages([1.1, 0.9, 0.0, 1.2])
        assert adv == pytest.approx(
            [0.547622575759252, 0.18254085858641736, -1.4603268686913389, 0.7301634343456694]
        )

    def test_gate_closed_group(self) -> None:
        # mean 1/3, std sqrt(1/3)
        adv = group_advantages([1.0, 0.0, 0.0])
        assert adv == pytest.approx([1.1545005730142688, -0.5772502865071344, -0.5772502865071344])

    def test_zero_std_gives_zero(self) -> None:
        assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
        assert group_advantages([0.0, 0.0]) == [0.0, 0.0]

    def test_unscored_left_out(self) -> None:
        # [1, 0] scored: mean .5, std sqrt(.5)
        adv = group_advantages([1.0, None, 0.0])
        assert adv == pytest.approx([0.7070067953266834, 0.0, -0.7070067953266834])
        assert group_advantages([1.0, None]) == [0.0, 0.0]

    def test_unscaled(self) -> None:
        assert group_advantages([1.1, 0.9, 0.0, 1.2], scale=False) == pytest.approx(
            [0.3, 0.1, -0.8, 0.4]
        )


class TestProposerReward:
    @pytest.mark.parametrize(
        ("lbar", "expected"),
        [(0.5, 1.0), (0.0, 0.0), (1.0, 0.0), (0.25, 0.5), (0.75, 0.5), (0.6, 0.8)],
    )
    def test_valid(self, lbar: float, expected: float) -> None:
        assert proposer_reward(True, lbar) == pytest.approx(expected)

    def test_invalid(self) -> None:
        assert proposer_reward(False, 0.5) == -1.0
        assert proposer_reward(False, None, invalid_reward=-0.5) == -0.5

    def test_unscorable(self) -> None:
        assert proposer_reward(True, None) is None

    def test_range(self) -> None:
        with pytest.raises(ValueError):
            proposer_reward(True, 1.5)


@dataclass
class _V:
    policy_version: int


class TestStaleness:
    def test_filter(self) -> None:
        samples = [_V(10), _V(9), _V(6), _V(5), _V(11)]
        kept, dropped = filter_stale(samples, current_version=10, max_staleness=4)
        assert [s.policy_version for s in kept] == [10, 9, 6, 11]  # 5 is 5 behind
        assert dropped == 1

    def test_zero_staleness_is_on_policy_only(self) -> None:
        kept, dropped = filter_stale([_V(10), _V(9), _V(11)], 10, 0)
        assert [s.policy_version for s in kept] == [10, 11] and dropped == 1

    def test_negative_bound(self) -> None:
        with pytest.raises(ValueError):
            filter_stale([_V(1)], 1, -1)

    def test_stats(self) -> None:
        assert staleness_stats([_V(10), _V(9), _V(6)], 10) == {
            "min": 0.0,
            "mean": pytest.approx(5 / 3),
            "max": 4.0,
        }
        assert staleness_stats([], 10) == {}
