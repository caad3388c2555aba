"""`kz rescore` with the real verifier (CPU path) and a SQLite store: kernels judged by an
older verifier version get a verdict of the current one beside the old, the drift names
the flips by check and the training step that used a flipped verdict, and a second run
has nothing left to do. On the fleet (`--fleet`), verifier services share the jobs as a
consumer group, judge each kernel once and give the drift of the one-process path; a
rescore job waits while a live batch is verified."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kz_stream.app import open_context
from kz_stream.bus import BusMessage
from kz_stream.cli import app
from kz_stream.config import Settings, TopicsConfig
from kz_stream.consumers.verifier import RESCORE_VERSION_HEADER, VerifierService
from kz_stream.events import (
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    TrainingStepCompleted,
    VerdictStatus,
    new_event,
)
from kz_stream.export import KernelFilter
from kz_stream.modules import CODER_EXAMPLE_MODULE, CODER_EXAMPLES
from kz_stream.rescore import Drift, plan_rescore, rescore, rescore_on_fleet
from kz_stream.store import open_store
from kz_stream.verify import VERIFIER_VERSION, Candidate, Problem, Verdict, Verifier, VerifierConfig

pytestmark = pytest.mark.slow

# kernel id -> (source, old status, old verifier version)
KERNELS = {
    "honest": (CODER_EXAMPLES["triton"], "incorrect", "kzv-0.9"),  # wrongly failed before
    "broken": ("class ModelNew(:\n", "correct", "kzv-0.9"),  # wrongly passed before
    "current": ("class ModelNew(:\n", "compile_error", VERIFIER_VERSION),  # judged already
}
# The flip cases and more wrongly passed kernels, so that two verifiers both get work.
FLEET_KERNELS = {**KERNELS, **{f"broken-{i}": KERNELS["broken"] for i in range(6)}}
CPU = VerifierConfig(devices=[], prewarm=0)


class CountingVerifier(Verifier):
    """The real verifier, counting the candidates it judges."""

    def __init__(self) -> None:
        super().__init__(CPU)
        self.judged = 0

    async def verify(self, problem: Problem, candidate: Candidate) -> Verdict:
        self.judged += 1
        return await super().verify(problem, candidate)


async def seed(url: str, events: list[Event]) -> None:
    async with open_store(url) as store:
        await store.append(events)


async def stored_verdicts(url: str) -> dict[str, list[KernelVerified]]:
    """Every kernel's verdicts, in store order."""
    async with open_store(url) as store:
        found: dict[str, list[KernelVerified]] = {}
        async for b in store.read_all(0, types=["KernelVerified"]):
            for r in b:
                v = KernelVerified.model_validate(r.event.payload)
                found.setdefault(v.kernel_id, []).append(v)
        return found


def history(kernels: dict[str, tuple[str, str, str]] = KERNELS) -> list[Event]:
    events = [new_event(ModuleProposed(module_id="m", api_set=["torch.relu"],
                                       source=CODER_EXAMPLE_MODULE,
                                       validation=ModuleValidation(valid=True)),
                        stream_id="module-m", stream_version=0, correlation_id="run-0")]
    for kid, (source, status, version) in kernels.items():
        events.append(new_event(
            KernelGenerated(kernel_id=kid, module_id="m", group_id="g", backend="triton",
                            source=source, policy_version=1),
            stream_id=f"kernel-{kid}", stream_version=0, correlation_id="run-0"))
        events.append(new_event(
            KernelVerified(kernel_id=kid, module_id="m", group_id="g",
                           status=VerdictStatus(status), verifier_version=version),
            stream_id=f"kernel-{kid}", stream_version=1, correlation_id="run-0"))
    events.append(new_event(
        TrainingStepCompleted(role="coder", step=3, policy_version=2,
                              kernel_ids=["broken", "current"]),
        stream_id="learner-coder", stream_version=0, correlation_id="run-0"))
    return events


def test_rescore_writes_new_verdicts_and_reports_the_drift(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"

    async def seed() -> None:
        async with open_store(url) as store:
            await store.append(history())

    asyncio.run(seed())
    env = {"KZ_DATABASE_URL": url, "KZ_VERIFIER__DEVICES": "[]", "COLUMNS": "200"}
    out = tmp_path / "drift.json"
    result = CliRunner().invoke(app, ["rescore", "--out", str(out)], env=env)
    assert result.exit_code == 0, result.output
    assert "2 of 3 kernels to verify" in result.stdout
    drift = json.loads(out.read_text())
    assert drift["rescored"] == 2 and drift["compared"] == 2 and drift["flipped"] == 2
    flips = {(f["from"], f["to"], f["check"]) for f in drift["flips"]}
    assert flips == {("incorrect", "correct", "-"), ("correct", "compile_error", "python_syntax")}
    assert drift["training_steps"] == [
        {"role": "coder", "step": 3, "policy_version": 2, "flipped_kernels": ["broken"]}]

    async def verdicts() -> dict[str, list[tuple[str, str]]]:
        async with open_store(url) as store:
            found: dict[str, list[tuple[str, str]]] = {}
            async for b in store.read_all(0, types=["KernelVerified"]):
                for r in b:
                    p = r.event.payload
                    found.setdefault(p["kernel_id"], []).append(
                        (p["verifier_version"], p["status"]))
            return found

    stored = asyncio.run(verdicts())
    # The old verdicts stay; the new ones sit beside them.
    assert stored["honest"] == [("kzv-0.9", "incorrect"), (VERIFIER_VERSION, "correct")]
    assert stored["broken"] == [("kzv-0.9", "correct"), (VERIFIER_VERSION, "compile_error")]
    assert stored["current"] == [(VERIFIER_VERSION, "compile_error")]

    again = CliRunner().invoke(app, ["rescore"], env=env)
    assert again.exit_code == 0, again.output
    assert "0 of 3 kernels to verify" in again.stdout


async def one_process_drift(tmp_path: Path) -> Drift:
    url = f"sqlite+aiosqlite:///{tmp_path}/one-process.sqlite3"
    await seed(url, history(FLEET_KERNELS))
    async with open_store(url) as store:
        plan = await plan_rescore(store, KernelFilter())
        return await rescore(store, Verifier(CPU), plan, producer="one-process")


async def test_two_verifiers_share_the_jobs_and_report_the_one_process_drift(
    tmp_path: Path, store_url: str
) -> None:
    expected = await one_process_drift(tmp_path)
    url = store_url  # SQLite, then PostgreSQL
    await seed(url, history(FLEET_KERNELS))
    settings = Settings(database_url=url, bus_url=f"memory://{uuid.uuid4().hex}",
                        topics=TopicsConfig(partitions=2), verifier=CPU)
    async with open_context(settings) as ctx:
        verifiers = [CountingVerifier(), CountingVerifier()]
        services = [VerifierService(replace(ctx, producer_id=f"verifier-{i}"), v)
                    for i, v in enumerate(verifiers)]
        runs = [asyncio.create_task(s.run()) for s in services]
        try:
            # Both in the rescore group before the jobs go out (one partition each).
            for _ in range(600):
                groups = [[sub for sub in s.subscriptions if sub.group == s.rescore_group]
                          for s in services]
                if all(g and g[0].assignment() for g in groups):
                    break
                await asyncio.sleep(0.05)
            plan = await plan_rescore(ctx.store, KernelFilter())
            todo = plan.todo()
            got = await rescore_on_fleet(ctx.store, ctx.bus, plan, topic=settings.topics.rescore,
                                         timeout_s=300, poll_s=0.1)
        finally:
            for s in services:
                s.request_stop()
            await asyncio.gather(*runs)

    assert got.as_dict() == expected.as_dict()
    assert got.flipped_kernels == ["broken", *(f"broken-{i}" for i in range(6)), "honest"]
    assert not got.missing
    # Each kernel judged once, by one of the two, and both had work.
    assert sum(v.judged for v in verifiers) == len(todo) == 8
    assert all(v.judged for v in verifiers)
    stored = await stored_verdicts(url)
    new = {kid: [v for v in vs if v.verifier_version == VERIFIER_VERSION]
           for kid, vs in stored.items()}
    assert all(len(vs) == 1 for vs in new.values()), new


async def test_a_rescore_job_waits_while_a_live_batch_is_verified(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    await seed(url, history())
    settings = Settings(database_url=url, bus_url=f"memory://{uuid.uuid4().hex}", verifier=CPU)
    async with open_context(settings) as ctx:
        async with CountingVerifier() as verifier:
            service = VerifierService(ctx, verifier, module_wait_s=1.5)
            # A live kernel whose module is nowhere keeps its batch busy for module_wait_s.
            orphan = new_event(
                KernelGenerated(kernel_id="orphan", module_id="nowhere", group_id="g",
                                backend="triton", source="class ModelNew(:\n"),
                stream_id="kernel-orphan", stream_version=0)
            plan = await plan_rescore(ctx.store, KernelFilter())
            job = BusMessage(settings.topics.rescore, 0, 0, None, b"",
                             {RESCORE_VERSION_HEADER: VERIFIER_VERSION.encode()},
                             plan.kernels["broken"])
            live = asyncio.create_task(service.verify_batch(
                [BusMessage(settings.topics.kernels, 0, 0, None, b"", event=orphan)]))
            await asyncio.sleep(0.1)
            rescoring = asyncio.create_task(service.rescore_batch([job]))
            await asyncio.sleep(1.0)
            assert verifier.judged == 0 and not rescoring.done()
            with pytest.raises(Exception, match="nowhere"):
                await live
            await asyncio.wait_for(rescoring, 60)
            assert verifier.judged == 1
            # Delivered again, the job is skipped: its verdict is stored.
            await service.rescore_batch([job])
            assert verifier.judged == 1
    stored = await stored_verdicts(url)
    assert [(v.verifier_version, v.status.value) for v in stored["broken"]] == [
        ("kzv-0.9", "correct"), (VERIFIER_VERSION, "compile_error")]


@contextmanager
def verifier_thread(settings: Settings) -> Iterator[CountingVerifier]:
    """A verifier service on its own event loop in a thread (the CLI runs its own loop)."""
    verifier = CountingVerifier()
    stop, started = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    async def serve() -> None:
        async with open_context(settings) as ctx:
            service = VerifierService(ctx, verifier)
            run = asyncio.create_task(service.run())
            started.set()
            await asyncio.to_thread(stop.wait)
            service.request_stop()
            await run

    def main() -> None:
        try:
            asyncio.run(serve())
        except BaseException as e:
            errors.append(e)
            started.set()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    started.wait(60)
    try:
        yield verifier
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors


@pytest.mark.kafka
def test_kz_rescore_on_a_broker_waits_for_the_fleet_and_resumes(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    asyncio.run(seed(url, history()))
    tag = uuid.uuid4().hex[:8]
    topics = TopicsConfig(**{f: f"{f}-{tag}" for f in ("modules", "kernels", "frontier",
                                                          "policy", "dead_letter", "rescore")},
                          partitions=2)
    env = {"KZ_DATABASE_URL": url, "KZ_BUS_URL": f"kafka://{kafka_bootstrap}",
           "KZ_VERIFIER__DEVICES": "[]", "COLUMNS": "200",
           **{f"KZ_TOPICS__{f.upper()}": getattr(topics, f) for f in
              ("modules", "kernels", "frontier", "policy", "dead_letter", "rescore")},
           "KZ_TOPICS__PARTITIONS": "2"}

    # No verifier yet: the jobs wait on the topic, and the command says what is missing.
    waited = CliRunner().invoke(app, ["rescore", "--timeout", "1"], env=env)
    assert waited.exit_code == 1, waited.output
    assert f"jobs on {topics.rescore}" in waited.stdout
    assert "2 of 2 verdicts did not come within 1s" in waited.stderr

    settings = Settings(database_url=url, bus_url=f"kafka://{kafka_bootstrap}", topics=topics,
                        verifier=CPU)
    out = tmp_path / "drift.json"
    with verifier_thread(settings) as verifier:
        done = CliRunner().invoke(app, ["rescore", "--timeout", "300", "--out", str(out)],
                                  env=env)
        assert done.exit_code == 0, done.output
        # The first run's jobs and the second's: each kernel judged once all the same.
        assert verifier.judged == 2
    drift = json.loads(out.read_text())
    assert (drift["rescored"], drift["flipped"], drift["missing"]) == (2, 2, [])
    assert {(f["from"], f["to"]) for f in drift["flips"]} == {
        ("incorrect", "correct"), ("correct", "compile_error")}

    again = CliRunner().invoke(app, ["rescore", "--timeout", "1"], env=env)
    assert again.exit_code == 0, again.output
    assert "0 of 3 kernels to verify" in again.stdout


def test_fleet_needs_a_broker(tmp_path: Path) -> None:
    env = {"KZ_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3", "COLUMNS": "200"}
    result = CliRunner().invoke(app, ["rescore", "--fleet"], env=env)
    assert result.exit_code == 1
    assert "the embedded bus (memory://) lives inside one process" in result.stderr


def varied_history() -> list[Event]:
    """Kernels of a broken source (the current verifier fails it at the syntax check) with
    verdict histories that the drift must read right."""
    histories: dict[str, list[tuple[str, str]]] = {
        # judged correct, then this version's verifier failed itself: judged again
        "retried": [("correct", "kzv-0.9"), ("infra_error", VERIFIER_VERSION)],
        # correct, then unchecked on a host that could not run it: the flip is from correct
        "unchecked-before": [("correct", "kzv-0.8"), ("unchecked", "kzv-0.9")],
        "unjudged": [],  # no verdict yet: its run's verifier gives the first
    }
    events = history({})[:1]  # the module
    for kid, verdicts in histories.items():
        events.append(new_event(
            KernelGenerated(kernel_id=kid, module_id="m", group_id="g", backend="triton",
                            source="class ModelNew(:\n", policy_version=1),
            stream_id=f"kernel-{kid}", stream_version=0, correlation_id="run-0"))
        for i, (status, version) in enumerate(verdicts, start=1):
            events.append(new_event(
                KernelVerified(kernel_id=kid, module_id="m", group_id="g",
                               status=VerdictStatus(status), verifier_version=version),
                event_id=uuid.uuid4(), stream_id=f"kernel-{kid}", stream_version=i,
                correlation_id="run-0"))
    return events


async def test_rescore_judges_the_verifiers_own_failures_again_and_compares_decided_verdicts(
    tmp_path: Path,
) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    await seed(url, varied_history())
    async with open_store(url) as store:
        plan = await plan_rescore(store, KernelFilter())
        assert sorted(plan.todo()) == ["retried", "unchecked-before"]
        assert plan.unjudged() == ["unjudged"]
        verifier = CountingVerifier()
        d = await rescore(store, verifier, plan, producer="test")
        assert verifier.judged == 2
        assert (d.rescored, d.judged, d.compared, d.undecided, d.unjudged) == (2, 2, 2, 0, 1)
        assert {(a, b) for a, b, _ in d.flips} == {("correct", "compile_error")}
        # Run again: nothing to judge, and the same drift from the stored verdicts.
        plan = await plan_rescore(store, KernelFilter())
        assert plan.todo() == []
        again = await rescore(store, verifier, plan, producer="test")
        assert verifier.judged == 2
        assert again.as_dict() == {**d.as_dict(), "rescored": 0}
    stored = await stored_verdicts(url)
    assert [(v.verifier_version, v.status.value) for v in stored["retried"]] == [
        ("kzv-0.9", "correct"), (VERIFIER_VERSION, "infra_error"),
        (VERIFIER_VERSION, "compile_error")]
    assert "unjudged" not in stored


async def test_a_rescore_job_judges_a_verifier_failure_again_once(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    await seed(url, varied_history())
    settings = Settings(database_url=url, bus_url=f"memory://{uuid.uuid4().hex}", verifier=CPU)
    async with open_context(settings) as ctx:
        async with CountingVerifier() as verifier:
            service = VerifierService(ctx, verifier)
            plan = await plan_rescore(ctx.store, KernelFilter())
            jobs = [BusMessage(settings.topics.rescore, 0, i, None, b"",
                               {RESCORE_VERSION_HEADER: VERIFIER_VERSION.encode()},
                               plan.kernels[kid])
                    for i, kid in enumerate(("retried", "unjudged"))]
            await service.rescore_batch(jobs)
            assert verifier.judged == 1  # the kernel with no verdict is the live verifier's
            await service.rescore_batch(jobs)  # delivered again: its new verdict is decided
            assert verifier.judged == 1
    stored = await stored_verdicts(url)
    assert [v.status.value for v in stored["retried"]] == [
        "correct", "infra_error", "compile_error"]
