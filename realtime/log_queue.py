"""Log lines leave the serving process's threads through a queue; a thread of their own writes them.

Writing a line to a file or pipe is a system call that releases the GIL; the event loop then waits to
take it back from the LLM or token2wav thread. Admitting a burst of streams logs a few lines per stream
on the loop, one stream after another (benchmarks/first_audio_gap.py measures the burst's admission).
Through the queue the loop only appends the record.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import queue
from collections.abc import Iterator, Sequence
from typing import cast

# The root logger (ours) and uvicorn's two loggers that do not propagate to it.
SERVING_LOGGERS = ("", "uvicorn", "uvicorn.access")

_Item = tuple[tuple[logging.Handler, ...], logging.LogRecord]


class _Enqueue(logging.handlers.QueueHandler):
    """Stands in for one logger's handlers: queues each record with them.

    The record goes as it is: its message is formatted on the writer thread by the handlers that write
    it (uvicorn's access formatter reads the record's arguments, which the stock QueueHandler folds into
    the message). Our log calls pass strings and numbers, which do not change meanwhile."""

    def __init__(self, items: queue.SimpleQueue[_Item], handlers: Sequence[logging.Handler]) -> None:
        super().__init__(items)
        self._handlers = tuple(handlers)

    def enqueue(self, record: logging.LogRecord) -> None:
        self.queue.put_nowait((self._handlers, record))

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


class _Writer(logging.handlers.QueueListener):
    """One thread for every logger's lines, so they keep the order they were logged in."""

    def handle(self, record: logging.LogRecord) -> None:
        item = cast(_Item, record)  # the queue holds `_Item`s (see `_Enqueue`)
        handlers, logged = item
        for handler in handlers:
            if logged.levelno >= handler.level:  # each handler keeps its own level
                handler.handle(logged)


@contextlib.contextmanager
def logs_through_queue(names: Sequence[str] = SERVING_LOGGERS) -> Iterator[None]:
    """While inside, the named loggers' handlers run on a writer thread; each logger gets one handler
    that queues its records. The handlers come back, every queued line written, on exit."""
    items: queue.SimpleQueue[_Item] = queue.SimpleQueue()
    swapped = [(logger, logger.handlers[:]) for logger in map(logging.getLogger, names) if logger.handlers]
    writer = _Writer(items)  # type: ignore[arg-type]  # carries `_Item`s, not bare records
    for logger, handlers in swapped:
        logger.handlers = [_Enqueue(items, handlers)]
    writer.start()
    try:
        yield
    finally:
        for logger, handlers in swapped:
            logger.handlers = handlers
        writer.stop()  # writes what is queued, then ends its thread
