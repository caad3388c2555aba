"""What a co-evolution run did, replayed from the event store: ``kz run``'s closing summary.

``summarize_run`` folds a run's stored events (those whose correlation id is the run id)
into a ``RunSummary`` with the learner's read model (``RunState``: modules, kernels and
their newest verdicts, policies loaded) plus the training steps and policy versions it
published. Everything comes from the store, not from the process's counters, so the
summary after a resumed run covers the sessions before it too. ``next_commands`` and
``render_summary`` turn it into the few lines ``kz run`` prints last.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, Required, TypedDict, Unpack

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.rule import Rule
from rich.table import Table

from kz_stream.events import (
    SYNTHESIZED_GROUP_PREFIX,
    PolicyVersionPublished,
    TrainingStepCompleted,
    VerdictStatus,
    payload_as,
)
from kz_stream.rl.schedule import AlternationConfig, AlternationSchedule, Role
from kz_stream.run_state import KernelRecord, RunState
from kz_stream.store import EventStore, RecordedEvent

__all__ = [
    "SUMMARY_TYPES",
    "Outcome",
    "RoleSummary",
    "RunSummary",
    "SessionInfo",
    "load_run_summary",
    "next_commands",
    "render_summary",
    "summarize_run",
]

Outcome = Literal["finished", "time_limit", "interrupted", "error"]
ROLES: tuple[Role, ...] = ("coder", "proposer")
# The event types a summary reads (frontier updates say nothing it reports).
SUMMARY_TYPES = (
    "ModuleProposed",
    "KernelGenerated",
    "KernelVerified",
    "TrainingStepCompleted",
    "PolicyVersionPublished",
    "PolicyVersionLoaded",
)


@dataclass(frozen=True)
class RoleSummary:
    """One role's training: its steps and what their samples scored, and its policies.

    ``step_rates`` is per step the Coder's pass rate on the kernels the step used (their
    newest verdicts) or the Proposer's valid rate on the proposals it used; ``rate`` is the
    same over the whole run (``rate_of`` out of ``rate_n``).
    """

    role: Role
    steps: int = 0
    steps_planned: int | None = None
    mean_rewards: tuple[float, ...] = ()
    step_rates: tuple[float | None, ...] = ()
    rate_of: int = 0
    rate_n: int = 0
    unscored: int = 0  # Proposer: valid proposals with no Coder verdict (no reward yet)
    published: tuple[int, ...] = ()  # versions, ascending
    loaded: int | None = None  # the newest version a generator reported loaded
    warm_start_uri: str | None = None  # version 0, where a warm start recorded it
    warm_start_packaged: bool = False  # ... and it is the adapter shipped with kz_stream
    latest_uri: str | None = None

    @property
    def rate(self) -> float | None:
        return self.rate_of / self.rate_n if self.rate_n else None

    @property
    def mean_reward(self) -> float | None:
        return statistics.fmean(self.mean_rewards) if self.mean_rewards else None

    @property
    def latest(self) -> int | None:
        return self.published[-1] if self.published else None


@dataclass(frozen=True)
class RunSummary:
    """A run as its stored events tell it, and how this session ended."""

    run_id: str
    outcome: Outcome
    detail: str = ""  # the time limit or the error, for the outcome line
    session_seconds: float = 0.0
    first_event_at: datetime | None = None
    resumed: bool = False  # the run has events from before this session
    position: int = 0  # the newest store position among the run's events
    rounds_done: int = 0
    rounds_planned: int | None = None
    modules: int = 0
    seed_modules: int = 0  # the run's seeds: modules no model wrote, published at its start
    synthesized_modules: int = 0  # the Proposer's fallback after a prompt with none valid
    kernels: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)  # newest verdict per kernel
    unverified: int = 0
    cut: int = 0  # kernels whose completion stopped at the token limit
    coder: RoleSummary = field(default_factory=lambda: RoleSummary("coder"))
    proposer: RoleSummary = field(default_factory=lambda: RoleSummary("proposer"))
    audit_kernel: str | None = None  # a kernel stream worth a look (``kz audit``)
    audit_status: str | None = None
    store: str = ""  # the store's URL, password hidden
    checkpoint_dir: str = ""


class SessionInfo(TypedDict, total=False):
    """How this session of a run ended, and what the summary takes besides the store."""

    outcome: Required[Outcome]
    detail: str  # the time limit or the error, for the outcome line
    session_seconds: float
    session_started: datetime | None  # events before it make the run a resumed one
    schedule: AlternationConfig | None  # the planned rounds and steps
    checkpoint_dir: str | Path


def summarize_run(
    records: Iterable[RecordedEvent],
    *,
    run_id: str,
    store: str = "",
    packaged_uris: Mapping[str, str] | None = None,
    **session: Unpack[SessionInfo],
) -> RunSummary:
    """Folds the stored events of run ``run_id`` (others in ``records`` are skipped), in
    position order, into a summary. ``store`` names the store (password hidden);
    ``packaged_uris`` (role -> URI) the shipped warm-start adapters, to name version 0."""
    state = RunState()
    steps: dict[Role, list[TrainingStepCompleted]] = {r: [] for r in ROLES}
    published: dict[Role, dict[int, PolicyVersionPublished]] = {r: {} for r in ROLES}
    first: datetime | None = None
    position = 0
    for rec in records:
        ev = rec.event
        if ev.correlation_id != run_id:
            continue
        position = max(position, rec.global_position)
        # When it happened, to the microsecond (SQLite stores recorded_at to the second).
        at = ev.occurred_at
        first = at if first is None else min(first, at)
        if ev.type == "TrainingStepCompleted":
            s = payload_as(ev, TrainingStepCompleted)
            steps[s.role].append(s)
        elif ev.type == "PolicyVersionPublished":
            p = payload_as(ev, PolicyVersionPublished)
            published[p.role][p.version] = p
        state.apply(ev, recorded_at=rec.recorded_at.timestamp())

    cfg = session.get("schedule")
    session_started = session.get("session_started")
    total_steps = sum(len(v) for v in steps.values())
    per_round = AlternationSchedule(cfg).steps_per_round if cfg else 0
    statuses = [k.verdict.status for k in state.kernels.values() if k.verdict is not None]
    order = {s: i for i, s in enumerate(VerdictStatus)}
    verdicts = {s.value: statuses.count(s) for s in sorted(set(statuses), key=order.__getitem__)}
    audit = _kernel_to_audit(state)
    return RunSummary(
        run_id=run_id,
        outcome=session["outcome"],
        detail=session.get("detail", ""),
        session_seconds=session.get("session_seconds", 0.0),
        first_event_at=first,
        resumed=first is not None and session_started is not None and first < session_started,
        position=position,
        rounds_done=total_steps // per_round if per_round else 0,
        rounds_planned=cfg.rounds if cfg else None,
        modules=len(state.modules),
        seed_modules=sum(m.event.completion is None
                         and not m.event.group_id.startswith(SYNTHESIZED_GROUP_PREFIX)
                         for m in state.modules.values()),
        synthesized_modules=sum(m.event.group_id.startswith(SYNTHESIZED_GROUP_PREFIX)
                                for m in state.modules.values()),
        kernels=len(state.kernels),
        verdicts=verdicts,
        unverified=len(state.kernels) - len(statuses),
        cut=sum(k.generated.cut_at_token_limit for k in state.kernels.values()),
        coder=_role(state, "coder", steps["coder"], published["coder"], cfg, packaged_uris),
        proposer=_role(
            state, "proposer", steps["proposer"], published["proposer"], cfg, packaged_uris
        ),
        audit_kernel=f"kernel-{audit.kernel_id}" if audit else None,
        audit_status=audit.verdict.status.value if audit and audit.verdict else None,
        store=store,
        checkpoint_dir=str(session.get("checkpoint_dir", "")),
    )


def _role(
    state: RunState,
    role: Role,
    steps: Sequence[TrainingStepCompleted],
    published: dict[int, PolicyVersionPublished],
    cfg: AlternationConfig | None,
    packaged_uris: Mapping[str, str] | None,
) -> RoleSummary:
    unscored = 0
    if role == "coder":
        decided = [k for k in state.kernels.values() if k.decided]
        rate_of, rate_n = sum(k.correct for k in decided), len(decided)
        step_rates = tuple(_pass_rate(state, s) for s in steps)
    else:
        # Only model-written proposals (seeds are no policy's work).
        proposals = [state.modules[m] for ms in state.proposals.values() for m in ms]
        rate_of, rate_n = sum(m.valid for m in proposals), len(proposals)
        step_rates = tuple(_valid_rate(state, s) for s in steps)
        scored = {k.module_id for k in state.kernels.values() if k.decided}
        unscored = sum(m.valid and m.module_id not in scored for m in proposals)
    versions = tuple(sorted(published))
    zero = published.get(0)
    loaded = [v for (r, _), v in state.loaded.items() if r == role]
    return RoleSummary(
        role=role,
        steps=len(steps),
        steps_planned=cfg.steps_for(role) * cfg.rounds if cfg and role in cfg.order else None,
        mean_rewards=tuple(s.mean_reward for s in steps),
        step_rates=step_rates,
        rate_of=rate_of,
        rate_n=rate_n,
        unscored=unscored,
        published=versions,
        loaded=max(loaded) if loaded else None,
        warm_start_uri=zero.uri if zero else None,
        warm_start_packaged=bool(zero and packaged_uris and packaged_uris.get(role) == zero.uri),
        latest_uri=published[versions[-1]].uri if versions else None,
    )


def _pass_rate(state: RunState, step: TrainingStepCompleted) -> float | None:
    """The share of correct kernels among the step's decided ones (newest verdicts)."""
    ids = step.kernel_ids or [
        k for g in step.group_ids if g in state.groups for k in state.groups[g].kernel_ids
    ]
    decided = [state.kernels[k] for k in ids if k in state.kernels and state.kernels[k].decided]
    return sum(k.correct for k in decided) / len(decided) if decided else None


def _valid_rate(state: RunState, step: TrainingStepCompleted) -> float | None:
    """The share of valid modules among the proposals the step used."""
    ids = step.module_ids or [m for g in step.group_ids for m in state.proposals.get(g, [])]
    mods = [state.modules[m] for m in ids if m in state.modules]
    return sum(m.valid for m in mods) / len(mods) if mods else None


def _kernel_to_audit(state: RunState) -> KernelRecord | None:
    """The newest correct kernel, else the newest judged one, else the newest one."""
    kernels = list(state.kernels.values())
    for pick in (lambda k: k.correct, lambda k: k.verdict is not None, lambda k: True):
        chosen = [k for k in kernels if pick(k)]
        if chosen:
            return chosen[-1]
    return None


async def load_run_summary(
    store: EventStore, run_id: str, *, store_url: str = "", **session: Unpack[SessionInfo]
) -> RunSummary:
    """Reads run ``run_id``'s events from ``store`` and summarizes them."""
    from kz_stream.database_url import redact as redact_url
    from kz_stream.warmstart import packaged_adapter

    records: list[RecordedEvent] = []
    async for batch in store.read_all(0, types=SUMMARY_TYPES, correlation_id=run_id):
        records.extend(batch)
    packaged: dict[str, str] = {
        role: path.resolve().as_uri() for role in ROLES if (path := packaged_adapter(role))
    }
    return summarize_run(
        records, run_id=run_id, store=redact_url(store_url) if store_url else "",
        packaged_uris=packaged, **session,
    )


# -- rendering ------------------------------------------------------------------------------


def next_commands(
    summary: RunSummary, *, config: Path | None = None, rerun: str | None = None
) -> list[tuple[str, str]]:
    """Two to four commands worth running next, with this run's arguments, each with what
    it shows. ``rerun``: the command line that resumes an unfinished run."""
    opt = f" --config {config}" if config else ""
    out: list[tuple[str, str]] = []
    if summary.outcome != "finished" and rerun:
        out.append((rerun, "resumes the run where it stopped"))
    if summary.audit_kernel:
        why = f"verdict {summary.audit_status}" if summary.audit_status else "no verdict yet"
        out.append((f"kz audit {summary.audit_kernel}{opt}", f"one kernel's history ({why})"))
    if summary.kernels:
        out.append((f"kz frontier --heatmap frontier.png{opt}", "pass rate per API, as an image"))
        out.append((f"kz dataset export {summary.run_id}-dataset --run {summary.run_id}{opt}",
                    "the run's kernels and verdicts as parquet"))
    latest = summary.coder.latest
    if latest:  # version 0 is the starting point, not this run's work
        out.append((f"kz eval run SUITE --policy run:{summary.run_id}:{latest}{opt}",
                    "the newest Coder on a KernelBench-format folder"))
    return out[:4]


def _duration(seconds: float) -> str:
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    m, s = divmod(s, 60)
    return f"{m}m {s:02d}s" if m < 60 else f"{m // 60}h {m % 60:02d}m"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _training(r: RoleSummary, rate_name: str) -> str:
    """Mean reward and the step's rate, first -> last step where there is more than one."""
    if not r.steps:
        return "no training step yet"
    if r.steps == 1:
        return f"mean reward {r.mean_rewards[0]:+.3f} (1 step)"
    first, last = r.step_rates[0], r.step_rates[-1]
    return (f"mean reward {r.mean_rewards[0]:+.3f} -> {r.mean_rewards[-1]:+.3f}, {rate_name} "
            f"{_pct(first)} -> {_pct(last)} (first -> last of {r.steps} steps)")


def _headline(s: RunSummary) -> str:
    took = _duration(s.session_seconds)
    why = f" ({s.detail})" if s.detail else ""
    head = {
        "finished": f"run {s.run_id} finished in {took}",
        "time_limit": f"run {s.run_id} stopped at the time limit{why} after {took}",
        "interrupted": f"run {s.run_id} interrupted after {took}",
        "error": f"run {s.run_id} stopped by an error after {took}{why}",
    }[s.outcome]
    if s.resumed and s.first_event_at is not None:
        head += f"; resumed, it began {s.first_event_at.astimezone(UTC):%Y-%m-%d %H:%M} UTC"
    return head


def _policies(r: RoleSummary) -> str:
    if not r.published:
        return f"{r.role} base model (no version published)"
    parts = [f"v{v}" for v in r.published]
    if r.warm_start_uri is not None:
        parts[0] = "v0 (packaged warm start)" if r.warm_start_packaged else "v0 (warm start)"
    else:  # no warm start recorded: the generators began with the base model
        parts.insert(0, "v0 (base model)")
    loaded = f", loaded v{r.loaded}" if r.loaded is not None else ", none loaded"
    return f"{r.role} {' -> '.join(parts)}{loaded}"


def render_summary(summary: RunSummary, commands: Sequence[tuple[str, str]] = ()) -> RenderableType:
    """The summary as a rule and a two-column grid: a few lines, no wall of text."""
    s = summary
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()

    def row(label: str, text: str) -> None:
        grid.add_row(label, escape(text))

    def steps(r: RoleSummary) -> str:
        return f"{r.role} {r.steps}" + (f"/{r.steps_planned}" if r.steps_planned else "")

    rounds = f"{s.rounds_done}" + (f" of {s.rounds_planned}" if s.rounds_planned else "")
    row("training", f"rounds {rounds}; steps {steps(s.coder)}, {steps(s.proposer)}")
    counts = ", ".join(f"{k} {v}" for k, v in s.verdicts.items()) or "no verdicts"
    if s.unverified:
        counts += f", unverified {s.unverified}"
    if s.cut:
        counts += (f"; {s.cut} cut at the Coder's token limit (its max_tokens; kz run "
                   "--max-new-tokens)")
    row("kernels", f"{s.kernels} generated: {counts}")
    c, p = s.coder, s.proposer
    seeds = f"; {s.seed_modules} seed module{'s' if s.seed_modules != 1 else ''}"
    if s.synthesized_modules:
        seeds += f"; {s.synthesized_modules} synthesized fallback"
    row("Coder", f"pass rate {_pct(c.rate)} ({c.rate_of}/{c.rate_n} judged); "
                 + _training(c, "pass rate"))
    # Valid proposals earn their reward only once the Coder has judged kernels for them:
    # without this, a step's -1.000 reads as if every proposal had been invalid.
    unscored = (f"; {p.unscored} valid proposal{'s' if p.unscored != 1 else ''} not yet "
                "scored by the Coder") if p.unscored else ""
    row("Proposer", f"valid {_pct(p.rate)} ({p.rate_of}/{p.rate_n} proposals{seeds}); "
                    + _training(p, "valid") + unscored)
    row("policies", f"{_policies(c)}; {_policies(p)}")
    where = s.store
    if s.checkpoint_dir:
        where += f"; checkpoints {s.checkpoint_dir}"
    row("stored", where)
    if commands:
        nxt = Table.grid(padding=(0, 2))
        nxt.add_column(style="cyan", no_wrap=True)
        nxt.add_column(style="dim")
        for cmd, why in commands:
            nxt.add_row(escape(cmd), escape(why))
        grid.add_row("next", nxt)
    style = "green" if s.outcome == "finished" else "red" if s.outcome == "error" else "yellow"
    return Group(Rule(escape(_headline(s)), style=style, align="left"), grid)

