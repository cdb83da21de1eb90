"""The LLM engines' start, begun as early as it may: while token2wav loads (from the loader's thread) for
engines with a fixed cache, else when the runtime asks for it. Owned by one runtime start; `end` cancels a
build still under way and waits for it, so that no engine thread starts after the runtime gave up."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from engines.llm.base import LLMEngine
from realtime.tasks import together

logger = logging.getLogger(__name__)


class LLMBuild:
    """The start of one set of LLM engines on `loop`: begun once (`chosen` or `begin`), awaited by `wait`,
    ended by `end`."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._task: asyncio.Task[list[None]] | None = None
        self._llms: tuple[LLMEngine, ...] = ()
        self._ended = False
        self._raised = False  # its failure went to a `wait`er: `end` need not log it again

    def chosen(self, llms: tuple[LLMEngine, ...]) -> None:
        """`load_engines`' `on_llms`, on the loader's thread: engines with a fixed cache start building now,
        while token2wav loads (a restart ~4 s sooner, docs/benchmarks.md twentieth session); one that sizes
        its cache by the free memory (TensorRT-LLM) waits for what token2wav takes."""
        if any(llm.sizes_cache_by_free_memory for llm in llms):
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed: the start was given up
            self._loop.call_soon_threadsafe(self.begin, llms)

    def begin(self, llms: Sequence[LLMEngine]) -> asyncio.Task[list[None]] | None:
        """The engines' start, begun on the first call (on the loop); None if `end`ed before it began."""
        if self._task is None and not self._ended:
            self._llms = tuple(llms)
            self._task = asyncio.ensure_future(together(*(llm.start() for llm in llms)))
        return self._task

    async def wait(self, llms: Sequence[LLMEngine]) -> None:
        """Begin (if not yet) and wait for the engines' start; its error, if it failed."""
        task = self.begin(llms)
        if task is None:
            raise RuntimeError("the LLM engines' start was ended before it began")
        try:
            await task
        except Exception:
            self._raised = True
            raise

    async def end(self) -> None:
        """No start from now on: cancel one under way and wait for it (a build thread cannot be stopped;
        its error, if it failed and no `wait` raised it, is logged), then stop the engines it started (a
        failure to stop one is logged: the others stop all the same). A cancellation of the caller
        meanwhile is raised after."""
        self._ended = True
        task = self._task
        if task is None:
            return
        caller = asyncio.current_task()
        cancelled_before = caller.cancelling() if caller is not None else 0
        if not task.done():
            task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        except Exception:
            if not self._raised:
                logger.exception("the LLM engines' start failed")
        for llm in self._llms:
            try:
                await llm.stop()
            except Exception:
                logger.exception("the %s LLM engine did not stop cleanly", llm.name)
        if caller is not None and caller.cancelling() > cancelled_before:
            raise asyncio.CancelledError
