"""The module synthesizer: catalog API sets become valid KernelBench-format modules."""

from __future__ import annotations

import hashlib
import random

import pytest

from kz_stream.modules import (
    ApiSetSampler,
    default_catalog,
    is_neutral,
    static_apis,
    validate_module,
)
from kz_stream.warmstart.ops import OPS, PROPOSER_OPS, ops_by_api
from kz_stream.warmstart.synth import (
    Synthesizer,
    feasible,
    is_held_out,
    synth_catalog,
    synthesize,
)


def test_every_op_is_a_catalog_api_with_one_home() -> None:
    catalog = default_catalog()
    assert len(ops_by_api()) == len(OPS)
    assert [op.api for op in OPS if op.api not in catalog.apis] == []


def test_proposer_ops_are_catalog_apis_apart_from_the_teachers() -> None:
    catalog = default_catalog()
    assert [op.api for op in PROPOSER_OPS if op.api not in catalog.apis] == []
    assert not {op.api for op in OPS} & {op.api for op in PROPOSER_OPS}
    assert all(op.teachable for op in OPS) and not any(op.teachable for op in PROPOSER_OPS)


def test_the_teachers_modules_are_the_ones_the_shipped_coder_learned() -> None:
    # The packaged Coder adapter was trained on seed 0's modules: the Proposer-only ops
    # must not change a single one of them.
    digests = "".join(m.digest for m in Synthesizer(seed=0).modules(800))
    assert hashlib.sha256(digests.encode()).hexdigest() == (
        "1c8d1d1b611428f40249bd93a75bdbb4bc0a96911d4af4d3cc10649663e0deca")


def test_the_proposers_modules_cover_most_of_what_it_is_asked_for() -> None:
    sampler = ApiSetSampler(seed=0)

    def share(teachable: bool) -> float:
        return sum(p for size in (2, 3) for k, p in sampler.probabilities(size).items()
                   if feasible(k, teachable=teachable)) / 2

    assert share(True) < 0.2 and share(False) > 0.65


def test_every_buildable_catalog_set_makes_a_module_that_calls_it_and_runs() -> None:
    import torch

    rng = random.Random(5)
    broad = synth_catalog(teachable=False)
    assert len(broad.pairs) > 2 * len(synth_catalog().pairs)
    for apis in [*broad.pairs, *broad.triples]:
        module = synthesize(list(apis), rng, teachable=False)
        called = [a for a in static_apis(module.source) if not is_neutral(a)]
        assert sorted(called) == sorted(apis), module.source
        space: dict[str, object] = {}
        exec(compile(module.source, "<module>", "exec"), space)
        model = space["Model"](*space["get_init_inputs"]())  # type: ignore[operator]
        with torch.no_grad():
            out = model(*space["get_inputs"]())  # type: ignore[operator]
        assert torch.isfinite(out.double()).all(), module.source


def test_feasible_sets_have_one_matmul_and_one_reduction_at_most() -> None:
    assert feasible(["torch.matmul", "torch.sigmoid", "torch.sum"])
    assert not feasible(["torch.matmul", "torch.nn.Linear"])
    assert not feasible(["torch.sum", "torch.mean"])
    assert not feasible(["torch.nn.Conv2d"])
    assert not feasible([])


def test_wider_sets_keep_one_shape_regime() -> None:
    assert feasible(["torch.nn.Embedding", "torch.nn.CrossEntropyLoss"], teachable=False)
    assert feasible(["torch.nn.Conv2d", "torch.nn.BatchNorm2d", "torch.relu"], teachable=False)
    assert not feasible(["torch.nn.Conv2d", "torch.nn.Conv1d"], teachable=False)
    assert not feasible(["torch.nn.Embedding", "torch.nn.Conv1d"], teachable=False)
    assert not feasible(["torch.argmax", "torch.sum"], teachable=False)
    assert not feasible(["torch.mm", "torch.nn.Conv2d"], teachable=False)
    assert not feasible(["torch.nn.Embedding"])  # not the teacher's


def test_the_restricted_catalog_keeps_only_buildable_sets() -> None:
    restricted = synth_catalog()
    assert restricted.pairs and restricted.triples
    assert all(feasible(k) for k in [*restricted.pairs, *restricted.triples])
    full = default_catalog()
    assert all(restricted.pairs[k] == full.pairs[k] for k in restricted.pairs)


def test_a_module_calls_exactly_its_api_set() -> None:
    rng = random.Random(3)
    for apis in (["torch.nn.Linear", "torch.nn.GELU", "torch.softmax"],
                 ["torch.maximum", "torch.nn.LayerNorm", "torch.sum"],
                 ["torch.tanh"]):
        module = synthesize(apis, rng)
        assert sorted(static_apis(module.source)) == sorted(apis)
        assert module.api_set == tuple(sorted(apis))


def test_kinds_follow_the_strongest_op() -> None:
    rng = random.Random(0)
    assert synthesize(["torch.mm", "torch.relu"], rng).kind == "matmul"
    assert synthesize(["torch.sigmoid", "torch.mean"], rng).kind == "reduction"
    assert synthesize(["torch.nn.RMSNorm", "torch.abs"], rng).kind == "norm"
    assert synthesize(["torch.sin", "torch.cos"], rng).kind == "fused"
    assert synthesize(["torch.sin"], rng).kind == "single"


def test_infeasible_sets_are_refused() -> None:
    with pytest.raises(ValueError, match="no module calls exactly"):
        synthesize(["torch.sum", "torch.amax"], random.Random(0))


def test_the_synthesizer_is_reproducible_and_yields_distinct_modules() -> None:
    first = [m.source for m in Synthesizer(seed=7).modules(40)]
    again = [m.source for m in Synthesizer(seed=7).modules(40)]
    assert first == again and len(set(first)) == 40
    assert first != [m.source for m in Synthesizer(seed=8).modules(40)]


def test_held_out_modules_are_a_function_of_their_source() -> None:
    modules = list(Synthesizer(seed=1).modules(200))
    held = [m for m in modules if is_held_out(m, 0.2)]
    assert 20 <= len(held) <= 60
    assert [m for m in modules if is_held_out(m, 0.2)] == held
    assert not any(is_held_out(m, 0.0) for m in modules)


@pytest.mark.slow
def test_synthesized_modules_pass_the_proposers_validation_and_admission() -> None:
    rng = random.Random(11)
    kinds = {"matmul": ["torch.nn.Linear", "torch.nn.SiLU", "torch.nn.LayerNorm"],
             "reduction": ["torch.maximum", "torch.logsumexp"],
             "norm": ["torch.nn.functional.normalize", "torch.exp"],
             "fused": ["torch.nn.functional.softplus", "torch.minimum"]}
    for kind, apis in kinds.items():
        module = synthesize(apis, rng)
        assert module.kind == kind
        result = validate_module(module.source, apis)
        assert result.valid, (apis, result.reason, result.detail, module.source)


@pytest.mark.slow
def test_proposer_only_modules_pass_the_proposers_validation_and_admission() -> None:
    rng = random.Random(2)
    for apis in (["torch.nn.Embedding", "torch.nn.Linear", "torch.nn.CrossEntropyLoss"],
                 ["torch.nn.Conv2d", "torch.nn.BatchNorm2d", "torch.relu"],
                 ["torch.where", "torch.topk"],
                 ["torch.gather", "torch.masked_fill", "torch.sum"],
                 ["torch.nn.Conv1d", "torch.nn.BatchNorm1d", "torch.sum"]):
        module = synthesize(apis, rng, teachable=False)
        result = validate_module(module.source, apis)
        assert result.valid, (apis, result.reason, result.detail, module.source)


def test_synthesized_seeds_join_the_hand_written_ones() -> None:
    from kz_stream.producers.seeds import synthesized_seeds

    seeds = synthesized_seeds(3)
    assert len(seeds) == 3 and synthesized_seeds(0) == ()
    assert all(sorted(static_apis(s.source)) == sorted(s.api_set) for s in seeds)
