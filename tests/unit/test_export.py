"""`kz dataset export`: the SFT and verdict sets replayed from a real SQLite store, with
their filters, written as parquet through `datasets` and read back."""

from __future__ import annotations

import asyncio
import re
import statistics
from datetime import UTC, datetime, timedelta
from pathlib import Path

from typer.testing import CliRunner

from kz_stream.cli import app
from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    new_event,
)
from kz_stream.export import DATASETS, KernelFilter, collect_rows, export_datasets
from kz_stream.store import open_store

T0 = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
# kernel id -> (run, module, [(status, speedup, verifier version)] in order)
KERNELS: dict[str, tuple[str, str, list[tuple[str, float | None, str]]]] = {
    "k1": ("run-a", "m1", [("correct", 3.0, "v1"), ("incorrect", None, "v2")]),  # re-scored
    "k2": ("run-a", "m1", [("correct", 2.0, "v1")]),
    "k3": ("run-a", "m1", [("incorrect", None, "v1")]),
    "k4": ("run-b", "m2", [("correct", None, "v1")]),
    "k5": ("run-b", "m2", [("compile_error", None, "v1")]),
    "k6": ("eval-x", "m1", [("correct", 3.0, "v1")]),
}


def events() -> list[Event]:
    out = [new_event(ModuleProposed(module_id=m, api_set=["torch.relu"], source=f"src {m}",
                                    validation=ModuleValidation(valid=True)),
                     stream_id=f"module-{m}", stream_version=0, correlation_id="run-a")
           for m in ("m1", "m2")]
    for minute, (kid, (run, module, verdicts)) in enumerate(KERNELS.items()):
        out.append(new_event(
            KernelGenerated(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                            backend="triton", source=f"kernel {kid}", prompt=f"prompt {module}",
                            policy_version=1),
            stream_id=f"kernel-{kid}", stream_version=0, correlation_id=run,
            occurred_at=T0 + timedelta(minutes=minute)))
        for i, (status, speedup, version) in enumerate(verdicts, start=1):
            out.append(new_event(
                KernelVerified(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                               status=VerdictStatus(status), speedup=speedup,
                               speedup_ci=(speedup * 0.9, speedup * 1.1) if speedup else None,
                               verifier_version=version),
                stream_id=f"kernel-{kid}", stream_version=i, correlation_id=run))
    return out


def test_sets_and_filters(store_url: str, tmp_path: Path) -> None:
    url = store_url

    async def go() -> None:
        async with open_store(url) as store:
            await store.append(events())
            rows, position = await collect_rows(store, KernelFilter())
            assert position == await store.last_position()
            # Every verdict of a training run, re-scores included; the evaluation left out.
            assert sorted((r["kernel_id"], r["verifier_version"]) for r in rows["verdicts"]) == [
                ("k1", "v1"), ("k1", "v2"), ("k2", "v1"), ("k3", "v1"), ("k4", "v1"),
                ("k5", "v1")]
            # k1 was fastest until its re-score failed it: the newest verdict counts.
            assert [(r["module_id"], r["kernel_id"], r["speedup"]) for r in rows["sft"]] == [
                ("m1", "k2", 2.0), ("m2", "k4", None)]
            assert rows["sft"][0]["module_source"] == "src m1"
            assert rows["sft"][0]["prompt"] == "prompt m1"
            # RL: the learner's view (k1's newest verdict is the failing re-score).
            rl = {r["module_id"]: r for r in rows["rl"]}
            assert (rl["m1"]["kernels"], rl["m1"]["correct"], rl["m1"]["median_speedup"]) == (
                3, 1, 2.0)
            assert rl["m2"]["pass_rate"] == 0.5 and rl["m2"]["median_speedup"] is None
            assert rl["m1"]["api_set"] == ["torch.relu"] and rl["m1"]["api_kernels"] == [5]
            assert rl["m1"]["api_pass_rates"] == [0.4]
            assert rl["m1"]["api_median_speedups"] == [2.0]

            rows, _ = await collect_rows(store, KernelFilter(statuses={"correct"},
                                                             runs={"run-a", "eval-x"}))
            assert sorted(r["kernel_id"] for r in rows["verdicts"]) == ["k1", "k2", "k6"]
            assert [r["kernel_id"] for r in rows["sft"]] == ["k6"]  # 3.0x beats 2.0x
            # A time window over when kernels were generated (k2 at minute 1, k4 at 3).
            window = KernelFilter(since=T0 + timedelta(minutes=1), until=T0 + timedelta(minutes=3))
            rows, _ = await collect_rows(store, window)
            assert sorted({r["kernel_id"] for r in rows["verdicts"]}) == ["k2", "k3"]
            rows, _ = await collect_rows(store, KernelFilter(), sets=("verdicts",))
            assert len(rows["verdicts"]) == 6 and rows["sft"] == rows["rl"] == []
            rows, _ = await collect_rows(store, KernelFilter(verifier_versions={"v2"}))
            assert [(r["kernel_id"], r["status"]) for r in rows["verdicts"]] == [
                ("k1", "incorrect")]
            assert rows["sft"] == []

    asyncio.run(go())

    out = tmp_path / "export"
    result = CliRunner().invoke(app, ["dataset", "export", str(out), "--run", "run-b",
                                      "--since", "2026-11-30T12:03:00"],
                                env={"KZ_DATABASE_URL": url, "COLUMNS": "200",
                                     "KZ_PROGRESS_EVERY_S": "0"})
    assert result.exit_code == 0, result.output
    assert "sft: 1 rows, verdicts: 2 rows, rl: 1 rows" in result.stdout
    # stderr is no terminal here: besides the bars drawn at the end, plain progress lines.
    assert re.search(r"^\[\d\d:\d\d:\d\d\] replaying the store \d+/\d+$", result.stderr,
                     re.MULTILINE), result.stderr

    from datasets import Dataset, load_dataset

    verdicts = Dataset.from_parquet(str(out / "verdicts.parquet"))
    assert isinstance(verdicts, Dataset)
    assert sorted(verdicts["status"]) == ["compile_error", "correct"]
    assert verdicts.features["speedup"].dtype == "float64"  # typed though every value is None
    card = (out / "README.md").read_text()
    assert "config_name: sft" in card and "runs run-b" in card
    assert "evaluation runs left out" in card  # run-b is a training run
    assert "generated from 2026-11-30 12:03:00+00:00" in card  # --since, read as UTC
    # The card's configs make the folder loadable by name.
    sft = load_dataset(str(out), "sft", split="train", cache_dir=str(tmp_path / "hf"))
    assert sft["kernel"] == ["kernel k4"]
    rl = Dataset.from_parquet(str(out / "rl.parquet"))
    assert isinstance(rl, Dataset) and rl[0]["api_pass_rates"] == [0.5]

    empty = CliRunner().invoke(app, ["dataset", "export", str(tmp_path / "none"), "--set",
                                     "sft", "--run", "run-z"], env={"KZ_DATABASE_URL": url})
    assert empty.exit_code == 0, empty.output
    assert "the filters matched nothing in this store" in empty.stderr
    # A status that is none, or an empty window, is refused (it chose nothing, silently).
    typo = CliRunner().invoke(app, ["dataset", "export", str(tmp_path / "typo"), "--status",
                                    "Correct"], env={"KZ_DATABASE_URL": url})
    assert typo.exit_code == 1 and "'Correct' is not a verdict status" in typo.output
    window = CliRunner().invoke(app, ["dataset", "export", str(tmp_path / "w"), "--since",
                                      "2027-01-01", "--until", "2026-01-01"],
                                env={"KZ_DATABASE_URL": url})
    assert window.exit_code == 1 and "is not before --until" in window.output
    assert not (tmp_path / "typo").exists() and not (tmp_path / "w").exists()
    # An empty set keeps its typed columns (datasets itself will not load 0 rows).
    import pyarrow.parquet as pq

    schema = pq.read_schema(tmp_path / "none" / "sft.parquet")
    assert schema.names[:2] == ["module_id", "backend"] and str(schema.field("speedup").type) == (
        "double")


def test_the_sft_kernel_is_the_newest_verifiers_fastest_and_undecided_verdicts_change_nothing(
    store_url: str,
) -> None:
    """m9: a kernel an old verifier timed at 7.6x (never re-scored; a memoising matmul
    was once that) does not beat one the current verifier timed at 2.0x. m8: the fastest
    kernel's re-score was the verifier's own failure; it stays the one taken."""
    verdicts = {"old": ("m9", [("correct", 7.6, "kzv-1.1")]),
                "new": ("m9", [("correct", 2.0, "kzv-1.4")]),
                "b1": ("m8", [("correct", 3.0, "kzv-1.3"), ("infra_error", None, "kzv-1.4")]),
                "b2": ("m8", [("correct", 1.1, "kzv-1.3"), ("unchecked", None, "kzv-1.4")])}
    history = []
    for kid, (module, judged) in verdicts.items():
        history.append(new_event(
            KernelGenerated(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                            backend="triton", source=f"kernel {kid}", prompt=f"prompt {module}"),
            stream_id=f"kernel-{kid}", stream_version=0, correlation_id="run-a"))
        history += [new_event(
            KernelVerified(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                           status=VerdictStatus(status), speedup=speedup,
                           verifier_version=version),
            stream_id=f"kernel-{kid}", stream_version=i, correlation_id="run-a")
            for i, (status, speedup, version) in enumerate(judged, start=1)]

    async def go() -> list[tuple[str, str]]:
        async with open_store(store_url) as store:
            await store.append(history)
            rows, _ = await collect_rows(store, KernelFilter(), sets=("sft",))
            return sorted((r["module_id"], r["kernel_id"]) for r in rows["sft"])

    assert asyncio.run(go()) == [("m8", "b1"), ("m9", "new")]


def test_a_training_module_that_is_an_evaluation_problem_is_left_out_of_sft_and_rl(
    store_url: str, tmp_path: Path,
) -> None:
    """The export's own decontamination: m7 has the normalized source of a problem that an
    evaluation stored after it (a Proposer started before the evaluation let it through);
    its correct kernel would have taught the evaluation's answer."""
    history = [
        new_event(ModuleProposed(module_id=m, api_set=["torch.relu"], source=f"src {m}",
                                 normalized_hash=h, validation=ModuleValidation(valid=True)),
                  stream_id=f"module-{m}", stream_version=0, correlation_id="run-a")
        for m, h in (("m6", "h-own"), ("m7", "h-kb19"))]
    for kid, module in (("k60", "m6"), ("k70", "m7")):
        history += [
            new_event(KernelGenerated(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                                      backend="triton", source=f"kernel {kid}"),
                      stream_id=f"kernel-{kid}", stream_version=0, correlation_id="run-a"),
            new_event(KernelVerified(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                                     status=VerdictStatus("correct"), speedup=1.5),
                      stream_id=f"kernel-{kid}", stream_version=1, correlation_id="run-a")]
    history.append(new_event(
        ModuleProposed(module_id="kb-19", api_set=["torch.relu"], source="src 19_ReLU",
                       normalized_hash="h-kb19", validation=ModuleValidation(valid=True)),
        stream_id="module-kb-19", stream_version=0, correlation_id="eval-kb"))

    async def go() -> None:
        async with open_store(store_url) as store:
            await store.append(history)
            counts, _ = await export_datasets(store, tmp_path, DATASETS, flt=KernelFilter(),
                                              store_url=store_url)
            assert counts == {"sft": 1, "verdicts": 2, "rl": 1}

    asyncio.run(go())
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "sft.parquet")["module_id"].to_pylist() == ["m6"]
    assert pq.read_table(tmp_path / "rl.parquet")["module_id"].to_pylist() == ["m6"]
    assert "Left out of `sft` and `rl`: 1 training module(s)" in (
        tmp_path / "README.md").read_text()


def more_events() -> list[Event]:
    """Beyond ``events()``: an invalid module, a module only an evaluation proposed, a kernel
    of a module never proposed, undecided verdicts, a verdict stored before its kernel
    (k12: the recorder lagged behind the verifier) and a late re-score."""
    out = [new_event(ModuleProposed(module_id="m3", api_set=["torch.sum", "torch.relu"],
                                    source="src m3", validation=ModuleValidation(valid=False)),
                     stream_id="module-m3", stream_version=0, correlation_id="run-a"),
           new_event(ModuleProposed(module_id="m5", api_set=["torch.exp"], source="src m5",
                                    validation=ModuleValidation(valid=True)),
                     stream_id="module-m5", stream_version=0, correlation_id="eval-x")]
    kernels = {"k7": ("run-a", "m3", "correct", 1.5), "k8": ("run-b", "m2", "infra_error", None),
               "k9": ("run-a", "m4", "correct", 1.2), "k10": ("run-a", "m5", "correct", 4.0),
               "k11": ("run-b", "m2", "unchecked", None), "k12": ("run-b", "m2", "correct", 1.1)}
    for minute, (kid, (run, module, status, speedup)) in enumerate(kernels.items(), start=10):
        out.append(new_event(
            KernelGenerated(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                            backend="cuda" if kid == "k12" else "triton",
                            source=f"kernel {kid}", prompt=f"prompt {module}"),
            stream_id=f"kernel-{kid}", stream_version=0, correlation_id=run,
            occurred_at=T0 + timedelta(minutes=minute)))
        out.insert(len(out) - (kid == "k12"), new_event(
            KernelVerified(kernel_id=kid, module_id=module, group_id=f"g-{module}",
                           status=VerdictStatus(status), speedup=speedup, verifier_version="v1"),
            stream_id=f"kernel-{kid}", stream_version=1, correlation_id=run))
    # k2 re-scored long after its first verdict, correct and faster: its texts are read back.
    out.append(new_event(
        KernelVerified(kernel_id="k2", module_id="m1", group_id="g-m1",
                       status=VerdictStatus("correct"), speedup=2.5, verifier_version="v2"),
        stream_id="kernel-k2", stream_version=2, correlation_id="run-a"))
    return out


def test_a_multi_chunk_export_writes_what_a_one_chunk_export_writes(
    store_url: str, tmp_path: Path
) -> None:
    import pyarrow.parquet as pq

    async def go() -> None:
        async with open_store(store_url) as store:
            await store.append(events() + more_events())
            for flt in (KernelFilter(), KernelFilter(include_evaluation=True),
                        KernelFilter(statuses={"correct"}, verifier_versions={"v1"})):
                rows, position = await collect_rows(store, flt)
                for chunk in (1, 3, 10_000):
                    out = tmp_path / f"{chunk}"
                    counts, at = await export_datasets(store, out, DATASETS, flt=flt,
                                                       store_url=store_url, chunk_rows=chunk)
                    assert at == position
                    assert counts == {name: len(rows[name]) for name in DATASETS}
                # The files of every chunk size are the same tables, schema metadata included.
                for name in DATASETS:
                    one = pq.read_table(tmp_path / "10000" / f"{name}.parquet")
                    assert pq.read_table(tmp_path / "1" / f"{name}.parquet").equals(
                        one, check_metadata=True)
                    assert pq.read_table(tmp_path / "3" / f"{name}.parquet").equals(one)
                    # ... and hold the rows gathered in memory, column for column.
                    assert one.to_pylist() == [{c: r[c] for c in one.column_names}
                                               for r in rows[name]]
                assert (tmp_path / "1" / "README.md").read_text() == (
                    tmp_path / "10000" / "README.md").read_text()
            written = pq.ParquetFile(tmp_path / "1" / "verdicts.parquet")
            assert written.metadata.num_row_groups == written.metadata.num_rows > 1

    asyncio.run(go())
    assert not list(tmp_path.glob("*/*.partial"))


def test_a_verdict_stored_before_its_kernel_is_exported(store_url: str) -> None:
    history = more_events()
    order = [(e.type, e.payload["kernel_id"]) for e in history if "kernel_id" in e.payload]
    assert order.index(("KernelVerified", "k12")) < order.index(("KernelGenerated", "k12"))

    async def go() -> None:
        async with open_store(store_url) as store:
            await store.append(events() + history)
            rows, _ = await collect_rows(store, KernelFilter())
            assert [(r["status"], r["source"]) for r in rows["verdicts"]
                    if r["kernel_id"] == "k12"] == [("correct", "kernel k12")]
            assert sorted((r["kernel_id"], r["backend"]) for r in rows["sft"]
                          if r["module_id"] == "m2") == [("k12", "cuda"), ("k4", "triton")]

    asyncio.run(go())


def test_verdicts_on_kernels_the_filter_leaves_out_are_not_held() -> None:
    """Held as early only while their kernel has not come: a verdict on a kernel of a run
    the filter leaves out would otherwise be held to the end of the replay."""
    from kz_stream.export import _Replay

    replay = _Replay(KernelFilter(runs={"run-b"}), sets=("sft", "verdicts", "rl"))
    for position, event in enumerate(events() + more_events(), start=1):
        replay.apply(event, position, "2026-11-30T12:00:00+00:00")
    assert replay.early == {}
    assert {"k1", "k12"} <= replay.generated and "k1" not in replay.kernels


def test_the_rl_set_is_the_learners_view_of_the_store(store_url: str) -> None:
    """The rl rows match what ``RunState`` and its capability map (the learner's own read
    of the store) say, evaluation runs, undecided verdicts and re-scores included."""
    from kz_stream.run_state import CapabilityMap, RunState

    history = events() + more_events()
    state = RunState()
    for ev in history:
        state.apply(ev)
    cmap = CapabilityMap.from_state(state)
    expected = {}
    for m in state.modules.values():
        mine = [k for k in state.kernels.values() if k.module_id == m.module_id and k.decided]
        if m.valid and mine:
            speeds = [k.verdict.speedup for k in mine if k.correct and k.verdict is not None
                      and k.verdict.speedup is not None]
            expected[m.module_id] = (
                len(mine), sum(k.correct for k in mine),
                statistics.median(speeds) if speeds else None,
                [cmap.apis[a].n for a in m.api_set], [cmap.apis[a].pass_rate for a in m.api_set])

    assert set(expected) == {"m1", "m2"}  # m3 is invalid, m4 and m5 unknown to the learner

    async def go() -> None:
        async with open_store(store_url) as store:
            await store.append(history)
            for flt in (KernelFilter(), KernelFilter(include_evaluation=True)):
                rows, _ = await collect_rows(store, flt, sets=("rl",))
                assert {r["module_id"]: (r["kernels"], r["correct"], r["median_speedup"],
                                         r["api_kernels"], r["api_pass_rates"])
                        for r in rows["rl"]} == expected

    asyncio.run(go())
