"""Log lines written off the calling thread (realtime/log_queue.py): every line still reaches its
handlers, formatted as before (uvicorn's access formatter reads the record's arguments), in order,
by a thread other than the one that logged; on exit the handlers are back and nothing is lost."""

from __future__ import annotations

import logging
import threading

from uvicorn.logging import AccessFormatter

from realtime.log_queue import logs_through_queue


class Lines(logging.Handler):
    def __init__(self, formatter: logging.Formatter, level: int = logging.NOTSET) -> None:
        super().__init__(level)
        self.setFormatter(formatter)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((self.format(record), threading.current_thread().name))


def test_records_reach_their_handlers_in_order_on_another_thread() -> None:
    ours, access = logging.getLogger("queue-test"), logging.getLogger("queue-test-access")
    ours.propagate = access.propagate = False
    plain = Lines(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    warnings_only = Lines(logging.Formatter("%(message)s"), level=logging.WARNING)
    requests = Lines(AccessFormatter('%(client_addr)s "%(request_line)s" %(status_code)s', use_colors=False))
    ours.handlers, access.handlers = [plain, warnings_only], [requests]
    ours.setLevel(logging.INFO)
    access.setLevel(logging.INFO)
    try:
        with logs_through_queue(["queue-test", "queue-test-access", "queue-test-without-handlers"]):
            assert ours.handlers != [plain, warnings_only]
            for index in range(50):
                ours.info("line %d of %s", index, "fifty")
            ours.warning("a warning")
            access.info('%s - "%s %s HTTP/%s" %d', "127.0.0.1:5000", "GET", "/readyz", "1.1", 200)
            try:
                raise ValueError("boom")
            except ValueError:
                ours.exception("failed")
        assert ours.handlers == [plain, warnings_only] and access.handlers == [requests]
        texts = [text for text, _ in plain.lines]
        assert texts[:50] == [f"INFO queue-test: line {i} of fifty" for i in range(50)]
        assert texts[50] == "WARNING queue-test: a warning"
        assert texts[51].startswith("ERROR queue-test: failed\nTraceback") and "ValueError: boom" in texts[51]
        assert [text for text, _ in warnings_only.lines][0] == "a warning"
        assert len(warnings_only.lines) == 2  # the warning and the error: its own level held
        assert [text for text, _ in requests.lines] == ['127.0.0.1:5000 "GET /readyz HTTP/1.1" 200 OK']
        caller = threading.current_thread().name
        assert all(thread != caller for _, thread in plain.lines + requests.lines)
    finally:
        ours.handlers, access.handlers = [], []
