"""Shared fixtures: the tiny synthetic models (built once per test session) and polling for state that
engine threads change. The service's end-to-end fixtures are in tests/realtime/conftest.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    # The engines' threads and the event loop already share the CI machine's two cores; intra-op
    # threads on top of them only contend (measured on 2 cores: tests/realtime 5-10% faster).
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models directory with random tiny weights in the released layout (with a `default` voice)."""
    from engines.build.synthetic import build_random

    return build_random(tmp_path_factory.mktemp("models") / "tiny", "tiny")


@pytest.fixture
def eventually() -> Callable[[Callable[[], bool]], Awaitable[None]]:
    """Await until `condition()` holds (engines free resources on their own threads); fails after 20 s."""

    async def wait(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
        async with asyncio.timeout(timeout_s):
            # The state lives on engine threads, which signal nothing to the loop: poll it.
            while not condition():  # noqa: ASYNC110
                await asyncio.sleep(0.02)

    return wait
