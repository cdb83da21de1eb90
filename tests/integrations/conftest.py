"""Fixtures of the integration tests: the real clients' own code (in their virtual environments, see
client_envs.py) driven as subprocesses against one live server on loopback.

A client script (clients/*.py) takes its arguments on the command line, talks only to the URL it is
given and prints one JSON object as its last stdout line; `run_client` returns it. Tests assert on it and
on the server's /metrics.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from client_envs import ENVS, ClientEnvError, ensure_env
from harness import ClientRunner, SlotsFreed, metric_value
from testing import LiveServer, serve, service_config

CLIENTS_DIR = Path(__file__).resolve().parent / "clients"
CLIENT_TIMEOUT_S = 240.0

@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def live_server(
    tiny_models: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[LiveServer]:
    async with serve(service_config(tiny_models, tmp_path_factory.mktemp("voices"))) as server:
        yield server


@pytest.fixture(scope="session")
def client_python() -> Callable[[str], Path]:
    """The Python of a client environment, built on first use (`make test` builds them beforehand)."""
    built: dict[str, Path] = {}

    def python(env: str) -> Path:
        assert env in ENVS, env
        if env not in built:
            try:
                built[env] = ensure_env(env)
            except ClientEnvError as exc:
                pytest.fail(str(exc))
        return built[env]

    return python


@pytest.fixture
def run_client(client_python: Callable[[str], Path], tmp_path: Path) -> ClientRunner:
    """`await run_client(env, "script.py", *args)`: the script's JSON result (its last stdout line).

    The subprocess is awaited without blocking the event loop the live server runs in; its output goes
    to files, so a client that hangs still shows what it logged."""

    async def run(env: str, script: str, *args: str, timeout_s: float = CLIENT_TIMEOUT_S) -> dict[str, Any]:
        python = client_python(env)
        out_path, err_path = tmp_path / f"{script}.out", tmp_path / f"{script}.err"
        with out_path.open("wb") as stdout, err_path.open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                str(python), str(CLIENTS_DIR / script), *args, stdout=stdout, stderr=stderr
            )
            try:
                async with asyncio.timeout(timeout_s):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()
        out = out_path.read_text(errors="replace")
        err = err_path.read_text(errors="replace")
        lines = out.strip().splitlines()
        if process.returncode != 0 or not lines:
            pytest.fail(
                f"{script} exited {process.returncode} (killed after {timeout_s:.0f} s if negative)\n"
                f"stdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}"
            )
        try:
            result = json.loads(lines[-1])
        except json.JSONDecodeError:
            pytest.fail(f"{script} printed no JSON result\nstdout:\n{out[-3000:]}\nstderr:\n{err[-6000:]}")
        assert isinstance(result, dict), result
        result["_stderr"] = err
        return result

    return run


@pytest.fixture
def slots_freed(live_server: LiveServer) -> SlotsFreed:
    """Await until /metrics shows no stream synthesising and no LLM slot held (fails after 20 s)."""

    async def check() -> None:
        async with asyncio.timeout(20):
            # /metrics is the server's to report: poll it.
            while (  # noqa: ASYNC110
                await metric_value(live_server, "tts_active_streams") != 0
                or await metric_value(live_server, "tts_llm_active_requests") != 0
            ):
                await asyncio.sleep(0.05)

    return check
