"""Shared fixtures: the tiny synthetic models (built once per test session) and polling for state that
engine threads change. The service's end-to-end fixtures are in tests/realtime/conftest.py."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import torch

from engines.compilation import use_tf32_matmuls


def pytest_configure(config: pytest.Config) -> None:
    # The engines' threads and the event loop already share the CI machine's two cores; intra-op
    # threads on top of them only contend (measured on 2 cores: tests/realtime 5-10% faster).
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def service_precision(request: pytest.FixtureRequest) -> Iterator[None]:
    """GPU tests run float32 work at the precision the service sets on CUDA (TF32 matmuls, which
    Inductor also compiles float32 graphs for); the setting is restored afterwards."""
    if request.node.get_closest_marker("gpu") is None or not torch.cuda.is_available():
        yield
        return
    matmul = torch.backends.cuda.matmul.fp32_precision
    conv = torch.backends.cudnn.conv.fp32_precision  # type: ignore[attr-defined]
    use_tf32_matmuls()
    try:
        yield
    finally:
        torch.backends.cuda.matmul.fp32_precision = matmul
        torch.backends.cudnn.conv.fp32_precision = conv  # type: ignore[attr-defined]


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
