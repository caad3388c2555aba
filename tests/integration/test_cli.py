"""The `kz` command line, run as a user would run it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kz_stream.bus import BusMessage, KafkaBus, TopicSpec, dead_letter_headers, event_headers
from kz_stream.cli import app
from kz_stream.events import (
    KernelGenerated,
    KernelVerified,
    ModuleProposed,
    ModuleValidation,
    VerdictStatus,
    encode_event,
    new_event,
)
from kz_stream.store import open_store


def kz(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kz_stream.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", **(env or {})},
        cwd=cwd,
        timeout=timeout,
    )


def seed_store(url: str) -> None:
    async def go() -> None:
        async with open_store(url) as store:
            await store.append(
                [
                    new_event(
                        ModuleProposed(
                            module_id="m",
                            api_set=["torch.relu"],
                            source="x",
                            validation=ModuleValidation(valid=True),
                        ),
                        stream_id="module-m",
                        stream_version=0,
                    ),
                    new_event(
                        KernelGenerated(
                            kernel_id="k", module_id="m", group_id="g", backend="triton", source="y"
                        ),
                        stream_id="kernel-k",
                        stream_version=0,
                    ),
                    new_event(
                        KernelVerified(
                            kernel_id="k",
                            module_id="m",
                            group_id="g",
                            status=VerdictStatus.CORRECT,
                            speedup=1.3,
                        ),
                        stream_id="kernel-k",
                        stream_version=1,
                    ),
                ]
            )

    asyncio.run(go())


@pytest.fixture
def db(tmp_path: Path) -> dict[str, str]:
    url = f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3"
    assert kz("db", "upgrade", env={"KZ_DATABASE_URL": url}).returncode == 0
    seed_store(url)
    return {"KZ_DATABASE_URL": url}


def test_audit_prints_a_streams_history_oldest_first(db: dict[str, str]) -> None:
    out = kz("audit", "kernel-k", "--json", env=db)
    assert out.returncode == 0, out.stderr
    events = [json.loads(line) for line in out.stdout.splitlines()]
    assert [e["type"] for e in events] == ["KernelGenerated", "KernelVerified"]
    human = kz("audit", "kernel-k", env=db)
    assert "KernelVerified" in human.stdout and "v1" in human.stdout


def test_an_unknown_stream_is_one_clear_error_line_and_exit_1(db: dict[str, str]) -> None:
    out = kz("audit", "kernel-nope", env=db)
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0
    assert "no stream 'kernel-nope'" in out.stderr and "Traceback" not in out.stderr


def test_replay_rebuilds_the_kernels_projection_and_reports_a_rate(db: dict[str, str]) -> None:
    out = kz("replay", "--projection", "kernels", env=db)
    assert out.returncode == 0, out.stderr
    assert "rebuilt kernels: 2 events" in out.stdout and "events/s" in out.stdout


def test_tail_prints_events_from_a_position(db: dict[str, str]) -> None:
    out = kz("tail", "--from", "0", "--limit", "3", env=db)
    assert out.returncode == 0, out.stderr
    assert [line.split()[1] for line in out.stdout.splitlines()] == [
        "ModuleProposed",
        "KernelGenerated",
        "KernelVerified",
    ]


def test_frontier_shows_the_capability_map_and_writes_a_heatmap(
    db: dict[str, str], tmp_path: Path
) -> None:
    png = tmp_path / "map.png"
    out = kz("frontier", "--heatmap", str(png), env=db)
    assert out.returncode == 0, out.stderr
    assert "torch.relu" in out.stdout and png.stat().st_size > 1000


def test_a_bad_database_url_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    out = kz("db", "upgrade", env={"KZ_DATABASE_URL": "nosuchdb://x"})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error:")


def test_an_unknown_service_is_refused(tmp_path: Path) -> None:
    out = kz("serve", "teleporter")
    assert out.returncode != 0 and "teleporter" in out.stderr


@pytest.mark.parametrize(("option", "value"), [("--backend", "fortran"), ("--kv-cache", "paged")])
def test_an_unknown_eval_choice_names_the_option_and_its_choices(
        option: str, value: str, tmp_path: Path) -> None:
    out = kz("eval", "run", str(tmp_path), option, value)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert f"{option}: {value!r} is not one of" in out.stderr


@pytest.mark.postgres
@pytest.mark.kafka
def test_infra_up_status_down_manage_local_postgres_and_broker() -> None:
    # Not tmp_path: when we run as root, the postgres user must be able to reach the dir.
    root = Path(tempfile.mkdtemp(prefix="kz-infra-"))
    root.chmod(0o755)
    env = {"KZ_INFRA_DIR": str(root)}
    up = kz("infra", "up", env=env)
    try:
        assert up.returncode == 0, up.stderr
        exports = dict(
            line.removeprefix("export ").split("=", 1) for line in up.stdout.splitlines()
        )
        assert exports["KZ_BUS_URL"].startswith("kafka://127.0.0.1:")
        status = kz("infra", "status", env=env)
        assert status.returncode == 0 and status.stdout.count("True") == 2, status.stdout
        upgraded = kz("db", "upgrade", env={**env, **exports})
        assert upgraded.returncode == 0, upgraded.stderr
    finally:
        down = kz("infra", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert kz("infra", "status", env=env).returncode == 1


@pytest.mark.parametrize(("args", "named"), [
    (["train", "--lora-r", "0"], "--lora-r"),
    (["train", "--rounds", "-1"], "--rounds"),
    (["train", "--groups-per-step", "0"], "--groups-per-step"),
    (["train", "--learning-rate", "-1e-5"], "--learning-rate"),
    (["train", "--steps-per-turn", "-2"], "--steps-per-turn"),
    (["train", "--role", "critic"], "critic"),
    (["run", "--rounds", "0"], "--rounds"),
    (["run", "--groups-per-step", "0"], "--groups-per-step"),
    (["run", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["run", "--proposer-max-new-tokens", "0"], "--proposer-max-new-tokens"),
    (["run", "--temperature", "-1"], "--temperature"),
])
def test_an_impossible_setting_is_one_error_naming_the_option_before_anything_starts(
        args: list[str], named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def started(*_: object, **__: object) -> None:
        raise AssertionError("the services started with an impossible setting")

    monkeypatch.setattr("kz_stream.app.run_named_services", started)
    monkeypatch.setattr("kz_stream.app.run_coevolution", started)
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output  # the CLI's one-line error
    assert named in result.output and "AssertionError" not in result.output


@pytest.mark.kafka
def test_dlq_list_and_redrive_on_the_broker(kafka_bootstrap: str) -> None:
    tag = uuid.uuid4().hex[:8]
    origin, dlq = f"kernels-{tag}", f"dlq-{tag}"
    env = {"KZ_BUS_URL": f"kafka://{kafka_bootstrap}", "KZ_TOPICS__DEAD_LETTER": dlq}
    event = new_event(
        KernelVerified(kernel_id="k", module_id="m", group_id="g", status=VerdictStatus.CORRECT),
        stream_id="kernel-k", stream_version=1,
    )
    dead = BusMessage(origin, 0, 41, b"kernel-k", encode_event(event), event_headers(event))

    async def setup() -> None:
        bus = KafkaBus(kafka_bootstrap)
        await bus.start()
        await bus.create_topics([TopicSpec(origin, 1), TopicSpec(dlq, 1)])
        headers = dead_letter_headers(dead, ValueError("no such module"), "kz-verifier")
        await bus.publish_raw(dlq, dead.value, key=dead.key, headers=headers)
        await bus.close()

    asyncio.run(setup())
    listed = kz("dlq", "list", "--json", env=env)
    assert listed.returncode == 0, listed.stderr
    [letter] = [json.loads(line) for line in listed.stdout.splitlines()]
    assert letter["origin"] == f"{origin}:0@41" and letter["group"] == "kz-verifier"
    assert letter["error"] == "ValueError: no such module" and letter["type"] == "KernelVerified"
    human = kz("dlq", "list", env=env)
    assert "1 dead letter(s)" in human.stdout and "kz-verifier" in human.stdout

    refused = kz("dlq", "redrive", env=env)
    assert refused.returncode != 0 and "--all" in refused.stderr
    redriven = kz("dlq", "redrive", "--origin", origin, env=env)
    assert redriven.returncode == 0, redriven.stderr
    assert f"re-drove 0@0 -> {origin}" in redriven.stdout

    async def read_origin() -> list[BusMessage]:
        bus = KafkaBus(kafka_bootstrap)
        await bus.start()
        try:
            return await bus.read_topic(origin)
        finally:
            await bus.close()

    [again] = asyncio.run(read_origin())
    assert again.value == dead.value and again.key == dead.key
    assert again.headers["kz-redriven-from"] == f"{dlq}:0@0".encode()
    assert "kz-error" not in again.headers


def test_dlq_refuses_the_embedded_bus() -> None:
    out = kz("dlq", "list", env={"KZ_BUS_URL": "memory://"})
    assert out.returncode == 1 and "embedded bus" in out.stderr
