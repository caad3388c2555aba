"""`kz run`'s closing summary, replayed from a real store: a finished run, a run cut short
(and then resumed), other runs and evaluations left out, and how it renders."""

from __future__ import annotations

import asyncio
import io
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console

from kz_stream.app import RunOptions
from kz_stream.cli import _rerun_command
from kz_stream.events import (
    Completion,
    Event,
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    Payload,
    PolicyVersionLoaded,
    PolicyVersionPublished,
    TrainingStepCompleted,
    VerdictStatus,
    new_event,
)
from kz_stream.rl import AlternationConfig
from kz_stream.store import RecordedEvent, open_store
from kz_stream.summary import (
    RunSummary,
    load_run_summary,
    next_commands,
    render_summary,
    summarize_run,
)
from kz_stream.warmstart import packaged_adapter

SCHEDULE = AlternationConfig(proposer_steps=1, coder_steps=1, rounds=2, order=("coder", "proposer"))


class Trail:
    """Events of runs as the services write them, with per-stream versions."""

    def __init__(self) -> None:
        self.versions: dict[str, int] = {}

    def event(self, payload: Payload, stream: str, run: str) -> Event:
        version = self.versions.get(stream, -1) + 1
        self.versions[stream] = version
        return new_event(payload, stream_id=stream, stream_version=version, correlation_id=run)

    def module(self, mid: str, *, run: str = "run-a", group: str = "", valid: bool = True,
               seed: bool = False) -> Event:
        return self.event(ModuleProposed(
            module_id=mid, group_id=group, api_set=["torch.relu"], source=f"src {mid}",
            completion=None if seed else Completion(text=f"src {mid}"),
            validation=ModuleValidation(valid=valid, reason=None if valid else "crash"),
        ), f"module-{mid}", run)

    def kernel(self, kid: str, group: str, *, run: str = "run-a", version: int = 0,
               finish: str | None = None) -> Event:
        return self.event(KernelGenerated(
            kernel_id=kid, module_id="m1", group_id=group, group_size=2, backend="triton",
            source=f"kernel {kid}", policy_version=version,
            completion=Completion(text=f"kernel {kid}", finish_reason=finish),
        ), f"kernel-{kid}", run)

    def verdict(self, kid: str, group: str, status: str, *, run: str = "run-a") -> Event:
        return self.event(KernelVerified(
            kernel_id=kid, module_id="m1", group_id=group, status=VerdictStatus(status),
        ), f"kernel-{kid}", run)

    def step(self, role: str, n: int, reward: float, *, kernels: list[str] | None = None,
             modules: list[str] | None = None, groups: list[str] | None = None) -> Event:
        return self.event(TrainingStepCompleted(
            role=role, step=n, policy_version=n, kernel_ids=kernels or [],  # type: ignore[arg-type]
            module_ids=modules or [], group_ids=groups or [], mean_reward=reward,
        ), f"learner-{role}", "run-a")

    def published(self, role: str, version: int, uri: str) -> Event:
        return self.event(PolicyVersionPublished(
            role=role, version=version, uri=uri, sha256="0" * 64,  # type: ignore[arg-type]
        ), f"policy-{role}", "run-a")

    def loaded(self, role: str, version: int) -> Event:
        return self.event(PolicyVersionLoaded(
            role=role, replica=f"{role}-0", version=version,  # type: ignore[arg-type]
        ), f"replica-{role}-0", "run-a")


def warm_uri(role: str) -> str:
    adapter = packaged_adapter(role)  # type: ignore[arg-type]
    assert adapter is not None, "the package ships both warm-start adapters"
    return adapter.resolve().as_uri()


def first_session(t: Trail) -> list[Event]:
    """The run up to its first Coder step, with another run and an evaluation mixed in."""
    return [
        t.published("coder", 0, warm_uri("coder")),
        t.published("proposer", 0, warm_uri("proposer")),
        t.module("seed-1", seed=True),
        t.module("p1", group="pg1"), t.module("p2", group="pg1", valid=False),
        t.kernel("k1", "g1"), t.kernel("k2", "g1"),
        t.verdict("k1", "g1", "correct"), t.verdict("k2", "g1", "compile_error"),
        t.kernel("k3", "g2"), t.kernel("k4", "g2"),
        t.verdict("k3", "g2", "runtime_error"),
        t.kernel("x1", "gx", run="run-b"), t.verdict("x1", "gx", "correct", run="run-b"),
        t.kernel("e1", "ge", run="eval-1"), t.verdict("e1", "ge", "hack", run="eval-1"),
        t.step("coder", 1, 0.5, kernels=["k1", "k2"]),
        t.published("coder", 1, "file:///ckpt/coder-v1"),
        t.loaded("coder", 1),
    ]


def second_session(t: Trail) -> list[Event]:
    """The rest of the schedule: a re-scored kernel, three more steps, two more policies."""
    return [
        t.verdict("k4", "g2", "hack"),
        t.step("proposer", 2, -0.5, modules=["p1", "p2"]),
        t.published("proposer", 1, "file:///ckpt/proposer-v1"),
        t.module("p3", group="pg2"), t.module("p4", group="pg2"),
        t.module("s1", group="synth-1", seed=True),  # the fallback after pg2: no seed
        t.kernel("k5", "g3", version=1), t.kernel("k6", "g3", version=1),
        t.verdict("k5", "g3", "incorrect"), t.verdict("k5", "g3", "correct"),  # re-scored
        t.step("coder", 3, -1.0, kernels=["k3", "k4"]),
        t.published("coder", 2, "file:///ckpt/coder-v2"),
        t.step("proposer", 4, 1.0, groups=["pg2"]),  # no module ids: its group names them
        t.published("proposer", 2, "file:///ckpt/proposer-v2"),
        t.loaded("coder", 2), t.loaded("proposer", 1),
    ]


def text(summary: RunSummary, commands: list[tuple[str, str]]) -> str:
    console = Console(width=200, file=io.StringIO(), color_system=None)
    console.print(render_summary(summary, commands))
    assert isinstance(console.file, io.StringIO)
    return console.file.getvalue()


def test_a_finished_run_from_its_stored_events(store_url: str) -> None:
    t = Trail()
    session = first_session(t) + second_session(t)

    async def go() -> RunSummary:
        async with open_store(store_url) as store:
            await store.append(session)
            return await load_run_summary(
                store, "run-a", outcome="finished", session_seconds=75.4, schedule=SCHEDULE,
                store_url=store_url, checkpoint_dir=Path(".kz/policies"))

    s = asyncio.run(go())
    assert (s.outcome, s.rounds_done, s.rounds_planned, s.resumed) == ("finished", 2, 2, False)
    # run-b's and the evaluation's kernels are not this run's.
    assert (s.kernels, s.unverified) == (6, 1)
    assert s.verdicts == {"correct": 2, "compile_error": 1, "runtime_error": 1, "hack": 1}
    assert list(s.verdicts) == ["correct", "compile_error", "runtime_error", "hack"]
    assert (s.modules, s.seed_modules, s.synthesized_modules) == (6, 1, 1)
    c, p = s.coder, s.proposer
    assert (c.steps, c.steps_planned, c.mean_rewards) == (2, 2, (0.5, -1.0))
    assert c.step_rates == (0.5, 0.0)  # k1 correct, k2 not; k3, k4 neither
    assert (c.rate_of, c.rate_n) == (2, 5)  # k1 and k5 (its newest verdict) of 5 judged
    assert (p.steps, p.mean_rewards, p.step_rates) == (2, (-0.5, 1.0), (0.5, 1.0))
    assert (p.rate_of, p.rate_n) == (3, 4)  # the seed is no proposal
    assert p.unscored == 3  # p1, p3, p4: valid, and the Coder judged kernels of m1 only
    assert (c.published, c.loaded, c.latest_uri) == ((0, 1, 2), 2, "file:///ckpt/coder-v2")
    assert c.warm_start_packaged and p.warm_start_packaged
    assert (p.published, p.loaded) == ((0, 1, 2), 1)
    assert (s.audit_kernel, s.audit_status) == ("kernel-k5", "correct")  # newest correct
    assert s.checkpoint_dir == ".kz/policies" and s.store.startswith(store_url.split(":")[0])

    commands = next_commands(s, rerun="kz run --rounds 2")
    assert [c for c, _ in commands] == [  # finished: no rerun
        "kz audit kernel-k5",
        "kz frontier --heatmap frontier.png",
        "kz dataset export run-a-dataset --run run-a",
        "kz eval run SUITE --policy run:run-a:2",
    ]
    shown = text(s, commands)
    lines = [line.rstrip() for line in shown.splitlines() if line.strip()]
    assert lines[0].startswith("run run-a finished in 1m 15s ─")
    assert len(lines) <= 12, shown  # a few lines, not a wall of text
    assert "6 generated: correct 2, compile_error 1, runtime_error 1, hack 1, unverified 1" in shown
    assert ("Coder     pass rate 40% (2/5 judged); mean reward +0.500 -> -1.000, pass rate "
            "50% -> 0% (first -> last of 2 steps)") in shown
    assert ("Proposer  valid 75% (3/4 proposals; 1 seed module; 1 synthesized fallback); "
            "mean reward -0.500 -> +1.000, "
            "valid 50% -> 100% (first -> last of 2 steps); 3 valid proposals not yet scored by "
            "the Coder") in shown
    assert ("coder v0 (packaged warm start) -> v1 -> v2, loaded v2; "
            "proposer v0 (packaged warm start) -> v1 -> v2, loaded v1") in shown
    assert lines[-1].strip().startswith("kz eval run SUITE --policy run:run-a:2")


def test_a_run_cut_short_then_resumed(store_url: str) -> None:
    t = Trail()
    first, rest = first_session(t), second_session(t)

    async def go() -> tuple[RunSummary, RunSummary]:
        async with open_store(store_url) as store:
            await store.append(first[:12])  # stopped before any training step
            cut = await load_run_summary(store, "run-a", outcome="interrupted",
                                         session_seconds=30, schedule=SCHEDULE)
            await store.append(first[12:])
            resumed_at = datetime.now(UTC)
            await store.append(rest)
            again = await load_run_summary(store, "run-a", outcome="time_limit",
                                           detail="900s", session_seconds=900,
                                           session_started=resumed_at, schedule=SCHEDULE)
            return cut, again

    cut, again = asyncio.run(go())
    assert (cut.outcome, cut.rounds_done, cut.coder.steps, cut.proposer.steps) == (
        "interrupted", 0, 0, 0)
    assert (cut.kernels, cut.unverified) == (4, 1)
    assert cut.coder.published == (0,) and cut.coder.latest == 0
    assert cut.coder.mean_reward is None and (cut.coder.rate_of, cut.coder.rate_n) == (1, 3)
    commands = next_commands(cut, config=Path("kz.toml"), rerun="kz run --config kz.toml")
    # Resuming comes first; no Coder was trained yet, so there is nothing to evaluate.
    assert [c for c, _ in commands] == [
        "kz run --config kz.toml",
        "kz audit kernel-k1 --config kz.toml",
        "kz frontier --heatmap frontier.png --config kz.toml",
        "kz dataset export run-a-dataset --run run-a --config kz.toml",
    ]
    shown = text(cut, commands)
    assert shown.startswith("run run-a interrupted after 30s")
    assert "rounds 0 of 2; steps coder 0/2, proposer 0/2" in shown
    assert "pass rate 33% (1/3 judged); no training step yet" in shown
    assert "coder v0 (packaged warm start), none loaded" in shown

    # The same store after the resumed session: the summary covers both sessions.
    assert again.resumed and again.rounds_done == 2 and again.kernels == 6
    assert again.coder.steps == again.proposer.steps == 2
    head = text(again, []).splitlines()[0]
    assert head.startswith("run run-a stopped at the time limit (900s) after 15m 00s; resumed, "
                           "it began "), head


def test_summarize_run_takes_records_in_any_mix() -> None:
    """Records of other runs are skipped; no records is an empty, honest summary."""
    t = Trail()
    now = datetime.now(UTC)
    records = [RecordedEvent(i, now, e) for i, e in enumerate(first_session(t), start=1)]
    other = summarize_run(records, run_id="run-b", outcome="finished")
    assert (other.kernels, other.verdicts, other.position) == (1, {"correct": 1}, 14)
    one = summarize_run(records, run_id="run-a", outcome="finished", schedule=SCHEDULE)
    assert (one.kernels, one.coder.steps, one.position) == (4, 1, 19)
    # Not told which adapters ship, it does not call version 0 packaged.
    assert one.coder.warm_start_uri == warm_uri("coder") and not one.coder.warm_start_packaged
    shown = text(one, [])
    assert "pass rate 33% (1/3 judged); mean reward +0.500 (1 step)" in shown
    assert "coder v0 (warm start) -> v1, loaded v1; proposer v0 (warm start), none loaded" in shown

    empty = summarize_run([], run_id="run-z", outcome="error", session_seconds=3)
    assert (empty.kernels, empty.coder.steps, empty.position) == (0, 0, 0)
    assert next_commands(empty) == []
    shown = text(empty, [])
    assert "run run-z stopped by an error after 3s" in shown
    assert "0 generated: no verdicts" in shown
    assert "coder base model (no version published)" in shown


def test_kernels_cut_at_the_token_limit_are_counted_with_the_option_that_lifts_it() -> None:
    t = Trail()
    now = datetime.now(UTC)
    events = [t.kernel("k1", "g1", finish="length"), t.kernel("k2", "g1", finish="stop"),
              t.verdict("k1", "g1", "compile_error"), t.verdict("k2", "g1", "correct")]
    s = summarize_run([RecordedEvent(i, now, e) for i, e in enumerate(events, start=1)],
                      run_id="run-a", outcome="finished")
    assert (s.kernels, s.cut) == (2, 1)
    assert ("2 generated: correct 1, compile_error 1; 1 cut at the Coder's token limit "
            "(its max_tokens; kz run --max-new-tokens)") in text(s, [])


def test_rerun_command_repeats_the_options_that_differ_from_the_defaults() -> None:
    assert _rerun_command(RunOptions(), None) == "kz run"
    options = RunOptions(rounds=2, groups_per_step=1, max_new_tokens=32,
                         proposer_max_new_tokens=300, temperature=0.5, time_limit_s=900.0)
    assert _rerun_command(options, Path("my.toml")) == (
        "kz run --config my.toml --rounds 2 --groups-per-step 1 --max-new-tokens 32 "
        "--proposer-max-new-tokens 300 --temperature 0.5 --time-limit 900")


def test_each_generator_gets_its_own_token_cap() -> None:
    from kz_stream.config import Settings

    settings = RunOptions(max_new_tokens=1000, proposer_max_new_tokens=300).apply(Settings())
    assert (settings.coder.llm.max_tokens, settings.proposer.llm.max_tokens) == (1000, 300)


def test_the_run_temperature_is_both_generators_and_so_the_learners() -> None:
    from kz_stream.config import Settings

    settings = RunOptions(temperature=0.5).apply(Settings())
    assert settings.coder.llm.temperature == settings.proposer.llm.temperature == 0.5
    assert RunOptions().apply(Settings()).coder.llm.temperature == Settings().coder.llm.temperature
