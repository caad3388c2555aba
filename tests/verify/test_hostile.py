"""The hostile-kernel corpus through the verifier's CPU path with the static scan off, so
that the filesystem boundary (and the audit hooks behind it) is what stands in the way:
nothing written outside a scratch folder, no connection made, nothing read leaks into a
verdict, no bomb process left, the verifier alive, and each a clear verdict."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kz_stream.testing.corpus.hostile import PROBLEM, HostileHost, acts, run_corpus
from kz_stream.testing.corpus.triton_honest import TRITON_HONEST
from kz_stream.verify import Candidate, Problem, Status, Verifier, VerifierConfig
from kz_stream.verify._sandbox import isolation

pytestmark = pytest.mark.skipif(
    isolation().level != "jail",
    reason=f"this host allows no filesystem boundary: {isolation().describe()}")

# The verdict each earns. Writes to /tmp land in the child's own /tmp (thrown away) and
# the module still computes a ReLU; numpy opens its file in Python, where the audit hook
# refuses first; the jail's first process shrugs off a SIGKILL from inside.
EXPECTED: dict[str, Status] = {
    **{f"{how}_tmp": Status.CORRECT for how in ("torch_save", "ctypes_fwrite")},
    **{f"numpy_tofile_{w}": Status.HACK for w in ("tmp", "project", "home")},
    **{f"{how}_{w}": Status.RUNTIME_ERROR for how in ("torch_save", "ctypes_fwrite")
       for w in ("project", "home")},
    **{n: Status.RUNTIME_ERROR for n in ("read_store", "read_infra_state", "read_home",
                                         "read_proc_verifier", "read_proc_other",
                                         "connect_store", "connect_broker", "fork_bomb",
                                         "kill_group")},
    "list_proc": Status.CORRECT,
    "memory_bomb": Status.OUT_OF_MEMORY,
    "time_bomb": Status.TIMEOUT,
    "kill_parent": Status.CORRECT,
}


@pytest.fixture(scope="module")
def host() -> Iterator[HostileHost]:
    h = HostileHost()
    yield h
    h.close()


@pytest.fixture(scope="module")
def verifier() -> Iterator[Verifier]:
    v = Verifier(VerifierConfig(devices=[], static_scan=False, prewarm=1, call_timeout_s=6,
                                cpu_worker_memory_mb=4096))
    yield v
    v.close_sync()


def test_every_act_has_an_expected_verdict(host: HostileHost) -> None:
    assert set(acts(host.targets)) == set(EXPECTED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_hostile_candidate_is_contained(verifier: Verifier, host: HostileHost,
                                        name: str) -> None:
    (out,) = run_corpus(verifier, host, [name])
    assert out.side_effects == [] and out.connections == 0, out
    assert not out.leaked and out.bomb_left == [], out
    assert out.status == EXPECTED[name].value, out


def test_verifier_alive_and_jailed_after_the_corpus(verifier: Verifier) -> None:
    v = verifier.verify_sync(Problem(PROBLEM), Candidate(TRITON_HONEST["relu"], "triton"))
    assert v.status is Status.CORRECT, v.reason
    assert v.hardware["isolation"] == "jail"
