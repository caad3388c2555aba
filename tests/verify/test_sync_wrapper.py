"""The synchronous wrapper's event loop (``Verifier.verify_sync``, ``close_sync``): an
interrupted call and a stop leave no task to be destroyed pending at exit."""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Coroutine
from typing import Any

import pytest

from kz_stream.verify._verifier import _LoopThread


def _work(cleaned: threading.Event) -> Coroutine[Any, Any, None]:
    async def work() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0)  # clean-up that needs the running loop
            cleaned.set()

    return work()


def test_an_interrupted_call_cancels_its_task_which_cleans_up_on_the_loop() -> None:
    loop_thread = _LoopThread()
    cleaned = threading.Event()
    # Ctrl-C as Python answers it by default, sent to the main thread itself: a
    # process-wide kill may land on another thread (torch's, the loop's), and a handler an
    # earlier test's event loop left installed (asyncio's runner cancels its own task
    # instead) never interrupts this wait (the suite hung for its 900 s timeout so, in
    # this project's CI VM).
    main = threading.main_thread().ident
    assert main is not None
    timer = threading.Timer(0.3, signal.pthread_kill, (main, signal.SIGINT))
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C while the call waits
            timer.start()
            loop_thread.run(_work(cleaned))
        assert cleaned.wait(5)
    finally:
        timer.cancel()
        loop_thread.stop()
        signal.signal(signal.SIGINT, before)


def test_stop_cancels_pending_tasks_and_lets_them_clean_up_first() -> None:
    loop_thread = _LoopThread()
    cleaned = threading.Event()
    asyncio.run_coroutine_threadsafe(_work(cleaned), loop_thread.loop)
    loop_thread.stop()
    assert cleaned.is_set()
    assert not loop_thread.thread.is_alive()
    assert not asyncio.all_tasks(loop_thread.loop)
