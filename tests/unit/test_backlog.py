"""A generator's backlog: items handed on and not yet answered."""

from __future__ import annotations

from kz_stream.producers._backlog import Backlog


def test_an_answer_takes_its_item_off() -> None:
    b = Backlog()
    b.add("a")
    b.add("b")
    b.answer("a")
    assert len(b) == 1 and "b" in b and "a" not in b and list(b) == ["b"]


def test_an_answered_item_is_not_counted_again() -> None:
    b = Backlog()
    b.answer("k")  # the verdict was read before its kernel
    b.add("k")
    assert len(b) == 0
    b.add("j")  # counted when handed on...
    b.answer("j")
    b.add("j")  # ...and read back from the store after its answer
    assert len(b) == 0


def test_items_passed_over_stop_counting_once_newer_ones_are_answered() -> None:
    b = Backlog()
    b.add("old", at=100.0)
    b.add("newer", at=105.0)
    b.add("newest", at=130.0)
    assert b.forget_passed_over(10) == 0  # nothing answered: a slow answerer holds them all
    b.answer("newest")
    # Counted more than 10 s before the newest answered item: passed over.
    assert b.forget_passed_over(10) == 2 and len(b) == 0


def test_items_close_to_the_newest_answered_keep_counting() -> None:
    b = Backlog()
    b.add("a", at=100.0)
    b.add("b", at=95.0)
    b.answer("a")
    assert b.forget_passed_over(10) == 0 and list(b) == ["b"]
