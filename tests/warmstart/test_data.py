"""`kz warmstart data` and `kz warmstart train` on the CPU: a few synthesized modules, the
teacher's kernels stored and judged by the real verifier (Triton interpreter), the two SFT
sets exported, and one SFT step of the embedded SmolLM2 that writes an adapter and its card."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kz_stream.cli import app
from kz_stream.store import open_store
from kz_stream.warmstart.data import (
    CODER_SFT,
    MANIFEST,
    PROPOSER_MANIFEST,
    PROPOSER_SFT,
    SftSets,
    teacher_run_id,
    twins_in_training,
)

pytestmark = pytest.mark.slow


async def stored_types(url: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    async with open_store(url, create_schema=False) as store:
        async for batch in store.read_all(0):
            for r in batch:
                counts[r.event.type] = counts.get(r.event.type, 0) + 1
    return counts


def test_data_then_train(tmp_path: Path) -> None:
    out = tmp_path / "ws"
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    env = {"KZ_DATABASE_URL": url, "KZ_VERIFIER__PREWARM": "1", "COLUMNS": "200"}
    cli = CliRunner()
    done = cli.invoke(app, ["warmstart", "data", str(out), "--count", "5", "--seed", "3",
                            "--held-out", "0.2"], env=env)
    assert done.exit_code == 0, done.output[-3000:]
    rows = [json.loads(line) for line in (out / MANIFEST).read_text().splitlines()]
    assert len(rows) == 5
    train = [r for r in rows if r["valid"] and r["split"] == "train"]
    assert train and all((out / r["file"]).exists() for r in train)
    coder = [json.loads(line) for line in (out / CODER_SFT).read_text().splitlines()]
    proposer = [json.loads(line) for line in (out / PROPOSER_SFT).read_text().splitlines()]
    # Every training module got a teacher kernel the verifier judged correct.
    assert len(coder) == len(proposer) == len(train)
    assert all(r["policy"] == teacher_run_id(out) for r in coder)
    assert all("@triton.jit" in r["completion"][0]["content"] for r in coder)
    system = coder[0]["prompt"][0]
    assert system["role"] == "system" and "ModelNew" in system["content"]
    counts = asyncio.run(stored_types(url))
    assert counts["KernelGenerated"] == counts["KernelVerified"] == len(train)
    assert f"teacher kernels: {len(train)} correct" in done.output

    again = cli.invoke(app, ["warmstart", "data", str(out), "--count", "5", "--seed", "3",
                             "--held-out", "0.2"], env=env)  # resumes: nothing new
    assert again.exit_code == 0, again.output[-3000:]
    assert asyncio.run(stored_types(url)) == counts

    adapter = tmp_path / "adapter"
    trained = cli.invoke(app, ["warmstart", "train", str(out / CODER_SFT), "--out", str(adapter),
                               "--limit", "1", "--epochs", "1", "--batch-size", "1",
                               "--max-length", "3072"], env=env)
    assert trained.exit_code == 0, trained.output[-3000:]
    card = json.loads((adapter / "warmstart.json").read_text())
    assert card["role"] == "coder" and card["kind"] == "lora" and card["data"]["rows"] == 1
    assert card["metrics"]["steps"] == 1 and card["metrics"]["train_loss"] > 0
    from safetensors.torch import load_file

    weights = load_file(str(adapter / "adapter_model.safetensors"))
    assert weights and {str(w.dtype) for w in weights.values()} == {"torch.bfloat16"}
    assert card["stored_as"].startswith("bfloat16") and not (adapter / "README.md").exists()
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "smollm2-135m-instruct-f32"
    assert not (adapter / "trainer").exists()


def test_progress_counts_the_modules_done_including_a_resumed_suite(tmp_path: Path) -> None:
    from kz_stream.warmstart.data import synthesize_suite

    seen: list[tuple[int, int]] = []
    synthesize_suite(tmp_path, count=2, seed=3, workers=1,
                     on_module=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 2), (2, 2)]
    seen.clear()
    synthesize_suite(tmp_path, count=3, seed=3, workers=1,
                     on_module=lambda done, total: seen.append((done, total)))
    assert seen == [(3, 3)]


def test_proposer_data_adds_modules_the_teacher_cannot_lower(tmp_path: Path) -> None:
    from kz_stream.warmstart.synth import feasible

    out = tmp_path / "ws"
    cli = CliRunner()
    args = ["warmstart", "proposer-data", str(out), "--count", "4", "--seed", "1"]
    done = cli.invoke(app, args, env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output[-3000:]
    rows = [json.loads(line) for line in (out / PROPOSER_MANIFEST).read_text().splitlines()]
    assert len(rows) == 4 and {r["split"] for r in rows} == {"proposer"}
    valid = [r for r in rows if r["valid"]]
    assert valid and all((out / r["file"]).exists() for r in valid)
    # seed 1's first modules include sets outside the teacher's ops
    assert any(not feasible(r["api_set"]) for r in rows)
    examples = [json.loads(line) for line in (out / PROPOSER_SFT).read_text().splitlines()]
    assert sorted(e["api_set"] for e in examples) == sorted(r["api_set"] for r in valid)
    assert all("class Model" in e["completion"][0]["content"] for e in examples)
    again = cli.invoke(app, args, env={"COLUMNS": "200"})  # resumes: nothing new
    assert again.exit_code == 0, again.output[-3000:]
    assert len((out / PROPOSER_MANIFEST).read_text().splitlines()) == 4


def test_proposer_eval_scores_every_sampled_set_in_draw_order(tmp_path: Path) -> None:
    from kz_stream.modules import ApiSetSampler

    out = tmp_path / "score.json"
    done = CliRunner().invoke(app, [
        "warmstart", "proposer-eval", "--policy", "base", "--sets", "2", "--seed", "4",
        "--max-new-tokens", "48", "--json", str(out)], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output[-3000:]
    score = json.loads(out.read_text())
    assert score["sets"] == 2 and score["temperature"] == 0.5 and score["seed"] == 4
    assert sum(score["reasons"].values()) == 2
    records = score["records"]
    assert [r["api_set"] for r in records] == ApiSetSampler(seed=4).sample_many(2)
    # 48 tokens cannot hold a whole module: each record says why it is not valid
    assert all(not r["valid"] and r["reason"] != "valid" and r["detail"] for r in records)


def test_teacher_kernels_the_host_could_not_judge_are_named_with_what_to_do() -> None:
    sets = SftSets(coder=361, proposer=651,
                   teacher_verdicts={"correct": 361, "infra_error": 290})
    assert sets.unjudged == 290
    line = sets.describe()
    assert line.startswith("teacher kernels: 361 correct, 290 infra_error; 290 could not be")
    assert "on a GPU" in line and "left out of the Coder set" in line
    judged = SftSets(coder=2, proposer=2, teacher_verdicts={"correct": 2, "compile_error": 1})
    assert judged.describe() == "teacher kernels: 2 correct, 1 compile_error"


def test_a_held_out_module_that_differs_from_a_training_one_only_in_sizes_is_its_twin() -> None:
    """The split by source hash puts such twins on both sides; measurement needs to know."""
    import random

    from kz_stream.warmstart.synth import synthesize

    relu = [synthesize(["torch.relu"], random.Random(seed)).source for seed in (1, 2)]
    softmax = synthesize(["torch.softmax"], random.Random(3)).source
    assert relu[0] != relu[1]  # other sizes
    assert twins_in_training([relu[1], softmax], train=[relu[0]]) == [True, False]
    assert twins_in_training([relu[1]], train=[softmax]) == [False]


def test_a_data_folder_keeps_its_teacher_run_id_when_moved(tmp_path: Path) -> None:
    first = teacher_run_id(tmp_path / "ws")
    (tmp_path / "ws").rename(tmp_path / "moved")
    assert teacher_run_id(tmp_path / "moved") == first
    assert teacher_run_id(tmp_path / "other") != first
