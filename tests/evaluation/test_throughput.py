"""An evaluation's throughput: stages overlap, so their times are unions of intervals."""

from __future__ import annotations

import pytest

from kz_stream.evaluation import StageTimes, throughput, union_seconds


def test_union_of_intervals_counts_overlaps_once() -> None:
    assert union_seconds([]) == 0
    assert union_seconds([(0, 2), (1, 3), (5, 6)]) == 4
    assert union_seconds([(2, 3), (0, 10)]) == 10
    assert union_seconds([(0, 1), (1, 2)]) == 2


def test_throughput_from_stage_times_by_hand() -> None:
    t = throughput({
        # one generation call [0, 10] sampled k1 and k2; they were verified concurrently
        "k1": StageTimes(generated_at=10, generation_s=10, verified_at=20, verification_s=8,
                         preparation_s=3),
        "k2": StageTimes(generated_at=10, generation_s=10, verified_at=25, verification_s=10,
                         preparation_s=3, build_s=1),
        # resumed long after: generated, not verified yet (the gap is not active time)
        "k3": StageTimes(generated_at=110, generation_s=5),
    })
    assert t.kernels == 2
    assert t.generation_s == 15  # [0, 10] and [105, 110]
    assert t.verification_s == 13  # [12, 25]
    assert t.preparation_s == 6  # [12, 15] and [16, 19] (after k2's 1 s build)
    assert t.active_s == 28  # [0, 10], [12, 25], [105, 110]
    assert t.kernels_per_minute == pytest.approx(2 / (28 / 60))
    assert t.as_dict()["generation_minutes"] == 0.25


def test_host_waits_come_after_the_preflight_and_before_the_preparation() -> None:
    t = throughput({
        # verified in [0, 30]: preflight [0, 2], host wait [2, 22], preparation [22, 27]
        "k1": StageTimes(verified_at=30, verification_s=30, preflight_s=2, host_wait_s=20,
                         preparation_s=5),
        # [10, 40]: joined k1's problem without waiting, its preparation done meanwhile
        "k2": StageTimes(verified_at=40, verification_s=30, preflight_s=3, preparation_s=0),
        # decided by the preflight alone: no wait, no preparation
        "k3": StageTimes(verified_at=50, verification_s=4, preflight_s=4),
    })
    assert t.host_wait_s == 20 and t.preparation_s == 5
    assert t.verification_s == 44  # [0, 40] and [46, 50]
    assert t.as_dict()["host_wait_minutes"] == round(20 / 60, 3)


def test_the_reference_facts_come_between_the_preflight_and_the_host_wait() -> None:
    # verified in [0, 30]: preflight [0, 2], facts [2, 10], host wait [10, 12],
    # preparation [12, 17]
    t = throughput({"k": StageTimes(verified_at=30, verification_s=30, preflight_s=2,
                                    reference_facts_s=8, host_wait_s=2, preparation_s=5)})
    assert t.host_wait_s == 2 and t.preparation_s == 5
    later = throughput({
        "k": StageTimes(verified_at=30, verification_s=30, preflight_s=2, reference_facts_s=8,
                        host_wait_s=2, preparation_s=5),
        "j": StageTimes(verified_at=16, verification_s=4, preparation_s=1),  # [12, 13]
    })
    assert later.preparation_s == 5  # [12, 13] inside [12, 17] (not [4, 9]: after the facts)


def test_kernels_without_times_count_but_add_no_time() -> None:
    t = throughput({"old": StageTimes(verified_at=5)})  # stored before times were recorded
    assert (t.kernels, t.active_s, t.kernels_per_minute) == (1, 0, None)
