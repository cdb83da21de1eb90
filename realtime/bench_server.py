"""The benchmark's server: `realtime serve` as a subprocess on a free loopback port, ready when /readyz
answers (used by `realtime bench`, benchmarks/load_profile.py and benchmarks/startup.py)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def spawned_process(
    models: Path | str | None, extra: Sequence[str], log: Path | None = None, ready_timeout_s: float = 900.0,
    launcher: Sequence[str] = (), stop_signal: signal.Signals = signal.SIGTERM,
) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A `realtime serve` subprocess on a free loopback port (its output in `log`, else inherited),
    started through `launcher` if given (a command prefix, e.g. a sampling profiler); yields (port,
    process) once /readyz answers, and sends `stop_signal` (then kills) at the end. RuntimeError when it
    exits first or is not ready within `ready_timeout_s`."""
    port = free_port()
    cmd = [*launcher, sys.executable, "-m", "realtime", "serve", "--host", "127.0.0.1", "--port", str(port),
           *extra]
    if models is not None:
        cmd += ["--models", str(models)]
    with contextlib.ExitStack() as files:
        output = None
        if log is not None:
            log.parent.mkdir(parents=True, exist_ok=True)
            output = files.enter_context(log.open("w"))
        proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, stdout=output,
                                stderr=subprocess.STDOUT if output is not None else None)
        try:
            deadline = time.monotonic() + ready_timeout_s
            while time.monotonic() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                        break
                time.sleep(0.2)  # benchmarks/startup.py times readiness by this poll
            else:
                raise RuntimeError(f"server was not ready within {ready_timeout_s:g} s")
            yield port, proc
        finally:
            proc.send_signal(stop_signal)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


WARMING = re.compile(r"^tts_token2wav_warmups_running (\S+)$", re.MULTILINE)


def wait_until_warm(port: int, timeout_s: float = 300.0,
                    process: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until the server on `port` has no token2wav warm-up left to run between calls (its /metrics'
    `tts_token2wav_warmups_running` is 0): a ready server may still be capturing graphs between calls,
    which a benchmark of steady serving should not time. RuntimeError after `timeout_s`, or once the
    server `process` (if given) has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode} while warming up")
        with contextlib.suppress(httpx.HTTPError):
            found = WARMING.search(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text)
            if found is not None and float(found.group(1)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"the server's warm-up was not finished within {timeout_s:g} s")


@contextlib.contextmanager
def spawned_server(models: Path | None, extra: Sequence[str]) -> Iterator[str]:
    """A server subprocess on a free loopback port; yields its websocket URL once /readyz answers and its
    warm-up is finished (`wait_until_warm`)."""
    with spawned_process(models, extra) as (port, process):
        wait_until_warm(port, process=process)
        yield f"ws://127.0.0.1:{port}/v1/ws"
