"""Coroutines run side by side, all or none."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

logger = logging.getLogger(__name__)


async def together(*steps: Coroutine[Any, Any, Any]) -> list[Any]:
    """`steps`' results, run side by side. If one fails, the others are cancelled and awaited before its
    exception propagates (`asyncio.gather` leaves them running: an LLM engine still building after a
    failed start would start its thread once the start had stopped everything); failures of the others
    besides the first are logged."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(step) for step in steps]
    except BaseExceptionGroup as failed:
        first, *others = failed.exceptions
        for other in others:
            logger.error("also failed: %s", type(other).__name__, exc_info=other)
        raise first from None
    return [task.result() for task in tasks]
