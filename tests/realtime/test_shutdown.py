"""`python -m realtime serve` as a process: SIGTERM lets a running stream finish, then the process ends.

uvicorn re-raises the signal once its shutdown is complete, so the process ends by SIGTERM (as the
parent asked) after the lifespan's drain has run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

FIXED = 150  # 6 s of speech: still streaming when the signal arrives
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def wait_ready(url: str, process: asyncio.subprocess.Process) -> None:
    async with httpx.AsyncClient() as http, asyncio.timeout(120):
        while process.returncode is None:
            try:
                if (await http.get(f"{url}/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise AssertionError(f"the server exited with {process.returncode} before it was ready")


async def test_sigterm_drains_running_streams_then_shuts_down(tiny_models, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "realtime", "serve", "--models", str(tiny_models), "--voices", str(tmp_path)),
        *("--port", str(port), "--drain-timeout", "60"),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await wait_ready(url, process)
        body = {
            "model": "tts-1",
            "input": "Finish this sentence please.",
            "response_format": "pcm",
            "fixed_length": FIXED,
        }
        async with (
            httpx.AsyncClient(base_url=url, timeout=120) as http,
            http.stream("POST", "/v1/audio/speech", json=body) as response,
        ):
            assert response.status_code == 200
            pieces = []
            async for piece in response.aiter_bytes():
                if not pieces:
                    process.send_signal(signal.SIGTERM)
                pieces.append(piece)
        audio = np.frombuffer(b"".join(pieces), dtype="<i2")
        assert audio.size == FIXED * 960
        assert await asyncio.wait_for(process.wait(), 60) == -signal.SIGTERM
    finally:
        if process.returncode is None:
            process.kill()
        stderr = (await process.stderr.read()).decode() if process.stderr else ""
        await process.wait()
    assert "draining" in stderr and "Application shutdown complete" in stderr
