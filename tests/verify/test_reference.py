"""Building the reference: perturbed weights drawn once per model, the same as ever."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
import torch
from torch import nn

from kz_stream.testing.perturb import perturb_first_form
from kz_stream.verify._reference import (
    ReferenceModule,
    build_model,
    forget_built_models,
    perturb_,
)


class Counted(nn.Module):
    """A module that counts its constructions, with every kind of state perturb_ meets."""

    built: ClassVar[int] = 0

    def __init__(self, width: int, scale: Any = 1.0) -> None:
        super().__init__()
        Counted.built += 1
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)  # ones and zeros before the noise
        self.wide = nn.Parameter(torch.randn(3, dtype=torch.float64))
        self.one = nn.Parameter(torch.tensor([0.5]))
        self.register_buffer("steps", torch.zeros(2, dtype=torch.long))
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.linear(x)) * self.wide.sum() * self.one


def _reference() -> ReferenceModule:
    return ReferenceModule(Counted, lambda: [torch.rand(2, 8)], lambda: [8])


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    forget_built_models()
    Counted.built = 0
    yield
    forget_built_models()


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_perturbation_draws_the_same_weights_as_the_plain_expressions() -> None:
    torch.manual_seed(3)
    mine = Counted(64)
    theirs = Counted(64)
    theirs.load_state_dict(mine.state_dict())
    perturb_(mine, 11)
    perturb_first_form(theirs, 11)
    _assert_same(_state(mine), _state(theirs))


def test_a_model_built_again_is_a_copy_with_a_fresh_builds_weights_and_rng_state() -> None:
    ref = _reference()
    first = build_model(ref, [8], 5, "cpu")
    after_first = torch.get_rng_state()
    weights = _state(first)
    first.linear.weight.data.zero_()  # a run that changes its model changes no later build
    torch.rand(4)  # nor does what happened to the RNG since
    second = build_model(ref, [8], 5, "cpu")
    assert Counted.built == 1
    _assert_same(_state(second), weights)
    assert torch.equal(torch.get_rng_state(), after_first)
    assert second is not first

    forget_built_models()
    fresh = build_model(ref, [8], 5, "cpu")
    assert Counted.built == 2
    _assert_same(_state(fresh), weights)


def test_other_arguments_or_another_seed_build_anew() -> None:
    ref = _reference()
    eight = _state(build_model(ref, [8], 5, "cpu"))
    other_seed = _state(build_model(ref, [8], 6, "cpu"))
    sixteen = build_model(ref, [16], 5, "cpu")
    assert Counted.built == 3
    assert not torch.equal(eight["linear.weight"], other_seed["linear.weight"])
    assert sixteen.linear.weight.shape == (16, 16)
    _assert_same(_state(build_model(ref, [8], 5, "cpu")), eight)


def test_arguments_whose_repr_elides_them_are_never_taken_for_each_other() -> None:
    ref = _reference()
    a, b = torch.zeros(2000), torch.zeros(2000)
    b[1000] = 1.0  # the same repr ("tensor([0., 0., ..., 0., 0.])"), different values
    assert repr(a) == repr(b)
    build_model(ref, [8, a], 5, "cpu")
    build_model(ref, [8, b], 5, "cpu")
    assert Counted.built == 2
