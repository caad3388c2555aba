"""`--policy` specs: the base model, a LoRA adapter folder, a policy version a run
published in the store, and an OpenAI-compatible URL (text only)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kz_stream.evaluation import EvalOptions, open_policy
from kz_stream.events import PolicyVersionPublished, new_event
from kz_stream.llm import VLLMServerBackend
from kz_stream.store import open_store
from tests.llm.conftest import make_lora

pytestmark = pytest.mark.slow


def published(version: int, uri: str) -> PolicyVersionPublished:
    from kz_stream.llm import smollm2_dir

    return PolicyVersionPublished(role="coder", version=version, uri=uri, sha256="0" * 64,
                                  base_model=str(smollm2_dir()))


def test_policy_specs(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    from kz_stream.llm import smollm2_dir

    adapter = make_lora(smollm2_dir(), tmp_path / "adapter", seed=0)
    options = EvalOptions(run_id="eval-p")

    async def go() -> None:
        async with open_store(f"sqlite+aiosqlite:///{tmp_path}/kz.sqlite3") as store:
            await store.append([
                new_event(published(v, f"file://{adapter}"), stream_id="policy-coder",
                          stream_version=v, correlation_id="run-a")
                for v in (1, 2)
            ])
            for spec, version in (("base", 0), (str(adapter), 1), ("run:run-a", 2),
                                  ("run:run-a:1", 1)):
                backend = await open_policy(spec, store, options)
                assert backend.policy_version == version, spec
                await backend.close()
            url = await open_policy("http://127.0.0.1:9/", store, options)
            assert isinstance(url, VLLMServerBackend) and not url.token_ids
            await url.close()
            with pytest.raises(LookupError, match="not 7"):
                await open_policy("run:run-a:7", store, options)
            with pytest.raises(LookupError, match="no Coder policy"):
                await open_policy("run:run-b", store, options)
            with pytest.raises(ValueError, match="not base"):
                await open_policy(str(tmp_path / "absent"), store, options)

    asyncio.run(go())
