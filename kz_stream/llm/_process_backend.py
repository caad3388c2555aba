"""A backend whose engine runs in a process of its own.

Two generators in one process share its GIL: on an H200 the folded Coder decoded 64-row
calls at 19.2 ms a step alone, 48.4 ms while the Proposer's backend decoded in the same
process, and 21.8 ms while it decoded in another (``benchmarks/bench_loop_decode.py
--beside``). ``ProcessBackend`` builds any backend (``create_backend``) in a spawned child
and forwards ``generate`` and ``load_policy`` to it over a pipe; many calls may be in
flight at once, and the child batches them as the in-process backend would. Written here
because no library proxies an asyncio object to another process: multiprocessing's
managers are synchronous and serve one call per connection at a time.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import threading
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from kz_stream.llm._base import (
    BackendError,
    BackendLost,
    Prompt,
    Sample,
    SamplingParams,
    ServingBackend,
)

__all__ = ["ProcessBackend"]

_START_TIMEOUT_S = 900.0  # a first run converts the GGUF model before it loads it
_CLOSE_TIMEOUT_S = 60.0


class ProcessBackend(ServingBackend):
    """``create_backend(kind, **options)`` in a child process; this process's GIL stays
    free of its decoding. The child exits when this backend closes or its parent dies."""

    def __init__(self, kind: str, *, log_level: str = "INFO", log_json: bool = True,
                 **options: Any) -> None:
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        self._conn, child_end = context.Pipe()
        self._process = context.Process(
            target=_serve, args=(child_end, kind, options, log_level, log_json),
            name=f"kz-{kind}-engine", daemon=True)
        self._process.start()
        child_end.close()
        # The reader thread and close() may both wait for the child: one at a time, or
        # one's waitpid reaps it while the other's finds no child and reports it alive.
        self._reap_lock = threading.Lock()
        if not self._conn.poll(_START_TIMEOUT_S):
            self._reap(0)
            raise BackendError(f"the {kind} engine process did not start in "
                               f"{_START_TIMEOUT_S:.0f} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._reap(5)
            raise BackendError(f"the {kind} engine process exited while starting "
                               f"(exit code {self._process.exitcode})") from None
        if message[0] != "ready":
            self._reap(5)
            raise BackendError(f"the {kind} engine could not start: {message[1]}")
        super().__init__(policy_version=message[1])
        self._ids = itertools.count()
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lost: str | None = None
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="kz-engine-reader",
                                        daemon=True)
        self._reader.start()

    async def _call(self, *request: Any) -> Any:
        if self._lost is not None:
            raise BackendLost(self._lost)
        self._loop = asyncio.get_running_loop()
        call_id = next(self._ids)
        future: asyncio.Future[Any] = self._loop.create_future()
        self._pending[call_id] = future
        try:
            with self._send_lock:
                self._conn.send((call_id, *request))
        except (OSError, ValueError) as e:
            self._pending.pop(call_id, None)
            raise BackendLost(f"the engine process is gone: {e}") from None
        try:
            return await future
        finally:
            self._pending.pop(call_id, None)

    def _read(self) -> None:
        """Hands each answer to its caller's future; fails them all if the child dies."""
        while True:
            try:
                call_id, ok, value = self._conn.recv()
            except (EOFError, OSError):
                break
            future = self._pending.get(call_id)
            if future is not None:
                self._settle_threadsafe(future, ok, value)
        self._reap(5, kill=False)  # a closing child may still be shutting down
        self._lost = f"the engine process exited (exit code {self._process.exitcode})"
        for future in list(self._pending.values()):
            self._settle_threadsafe(future, False, BackendLost(self._lost))

    def _settle_threadsafe(self, future: asyncio.Future[Any], ok: bool, value: Any) -> None:
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_settle, future, ok, value)
        except RuntimeError:
            pass  # the caller's loop is closed: nobody awaits the answer any more

    async def _generate(
        self, prompts: Sequence[Prompt], n: int, sampling: SamplingParams
    ) -> list[list[Sample]]:
        result: list[list[Sample]] = await self._call("generate", list(prompts), n, sampling)
        return result

    async def _load_policy(self, version: int, path: str, kind: str) -> None:
        await self._call("load_policy", version, path, kind)
        self._version = version

    async def _close(self) -> None:
        if self._lost is None:
            try:
                await asyncio.wait_for(self._call("close"), _CLOSE_TIMEOUT_S)
            except (BackendError, TimeoutError):
                pass
        await asyncio.to_thread(self._reap, _CLOSE_TIMEOUT_S)
        self._conn.close()

    def _reap(self, timeout: float, *, kill: bool = True) -> None:
        """Waits up to ``timeout`` for the child to exit; with ``kill``, kills it if it has
        not and returns once it is reaped (its exit code known)."""
        with self._reap_lock:
            self._process.join(timeout)
            if kill and self._process.exitcode is None:
                # Also the case of a child whose pipes have closed but that is not yet a
                # zombie: join's WNOHANG poll missed it. A blocking join waits it out.
                self._process.kill()
                self._process.join()


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value if isinstance(value, BackendError) else BackendError(str(value)))


def _serve(conn: Connection, kind: str, options: dict[str, Any], log_level: str,
           log_json: bool) -> None:
    """The child: builds the backend, then answers requests until told to close or until
    its parent's end of the pipe closes."""
    from kz_stream.llm._factory import create_backend
    from kz_stream.logging import configure_logging

    configure_logging(log_level, json=log_json)
    try:
        backend = create_backend(kind, **options)  # type: ignore[arg-type]
    except Exception as e:
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", backend.policy_version))
    asyncio.run(_answer(conn, backend))


async def _answer(conn: Connection, backend: Any) -> None:
    loop = asyncio.get_running_loop()
    requests: asyncio.Queue[tuple[Any, ...] | None] = asyncio.Queue()

    def receive() -> None:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                request = None  # the parent is gone
            try:
                loop.call_soon_threadsafe(requests.put_nowait, request)
            except RuntimeError:
                return  # the child's loop has ended (it was told to close)
            if request is None:
                return

    threading.Thread(target=receive, name="kz-engine-requests", daemon=True).start()
    tasks: set[asyncio.Task[None]] = set()

    async def run(call_id: int, op: str, args: tuple[Any, ...]) -> None:
        try:
            if op == "generate":
                prompts, n, sampling = args
                value: Any = await backend.generate(prompts, n=n, sampling=sampling)
            elif op == "load_policy":
                version, path, kind = args
                value = await backend.load_policy(version, path, kind=kind)
            else:
                raise ValueError(f"unknown request {op!r}")
            conn.send((call_id, True, value))
        except Exception as e:
            conn.send((call_id, False, f"{type(e).__name__}: {e}"))

    try:
        while (request := await requests.get()) is not None:
            call_id, op, *args = request
            if op == "close":
                await asyncio.gather(*tasks, return_exceptions=True)
                await backend.close()
                conn.send((call_id, True, None))
                return
            task = asyncio.create_task(run(call_id, op, tuple(args)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
    finally:
        await backend.close()
