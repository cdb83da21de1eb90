"""Replicas sharing one voices directory (a Kubernetes volume): two server processes — one in this
test's process, one started as `python -m realtime serve` — see each other's uploads on first use and
each other's deletes, and two uploads of one id at once leave exactly one voice."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from test_shutdown import REPO, free_port, wait_ready
from test_voices_api import FIXED, speak, upload, wav_bytes
from testing import serve, service_config

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest_asyncio.fixture(loop_scope="session")
async def other_replica(tiny_models: Path, tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A server process on `tmp_path/voices` that re-reads the directory only every hour: what it
    knows of other replicas' voices comes from first use, not from its periodic sync."""
    voices = tmp_path / "voices"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "realtime", "serve", "--models", str(tiny_models), "--voices", str(voices)),
        *("--port", str(port), "--device", "cpu", "--voice-sync", "3600"),
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await wait_ready(url, process)
        yield url, voices
    finally:
        process.terminate()
        await process.wait()


async def listed(http: httpx.AsyncClient) -> set[str]:
    return {voice["voice_id"] for voice in (await http.get("/v1/voices")).json()["data"]}


async def test_two_replicas_share_uploads_deletes_and_ids(
    tiny_models: Path, other_replica: tuple[str, Path]
) -> None:
    url_b, voices = other_replica
    config = service_config(tiny_models, voices, device="cpu", voice_sync_s=0.2)
    async with (
        serve(config) as replica_a,
        httpx.AsyncClient(base_url=replica_a.http_url, timeout=120) as a,
        httpx.AsyncClient(base_url=url_b, timeout=120) as b,
    ):
        # Uploaded to A, spoken by B at once: B loads it from the directory on this first use.
        assert (await upload(a, "shared", wav_bytes(3.0))).status_code == 201
        spoken = await speak(b, "shared")
        assert spoken.status_code == 200 and len(spoken.content) == FIXED * 960 * 2
        assert "shared" in await listed(b)

        # Two uploads of one id at once, one per replica: exactly one wins.
        statuses = await asyncio.gather(upload(a, "race", wav_bytes(3.0)), upload(b, "race", wav_bytes(3.0)))
        assert sorted(response.status_code for response in statuses) == [201, 409]
        assert (await speak(a, "race")).status_code == 200 and (await speak(b, "race")).status_code == 200

        # Deleted on B: A no longer speaks it, nor lists it.
        assert (await b.delete("/v1/voices/shared")).status_code == 204
        assert (await speak(a, "shared")).status_code == 404
        assert "shared" not in await listed(a)

        # Uploaded to B and deleted there: A's periodic sync lists it, then drops it, unasked.
        assert (await upload(b, "from-b", wav_bytes(3.0))).status_code == 201
        async with asyncio.timeout(30):
            # The state is another process's: nothing here can signal it, so poll.
            while "from-b" not in await listed(a):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
        assert (await b.delete("/v1/voices/from-b")).status_code == 204
        async with asyncio.timeout(30):
            while "from-b" in await listed(a):  # noqa: ASYNC110
                await asyncio.sleep(0.1)
