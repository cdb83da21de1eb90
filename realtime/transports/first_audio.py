"""HTTP routes answer only once a session's first audio chunk has arrived: an error before any audio
(text the front end refuses, the LLM's waiting line full, a prompt too long for its context) then
still gets its status code and its API's error shape, instead of a 200 whose body stops short."""

from __future__ import annotations

from collections.abc import AsyncIterator

from realtime.session import AudioChunk, Session


async def first_chunk(session: Session) -> AudioChunk | None:
    """The session's first chunk (None if it has none); raises its error, closing it, if it fails."""
    try:
        return await anext(session)
    except StopAsyncIteration:
        return None
    except BaseException:
        await session.aclose()
        raise


async def chunks_from(first: AudioChunk | None, session: Session) -> AsyncIterator[AudioChunk]:
    """`first` (already taken from `session`), then the rest of the session's chunks."""
    if first is not None:
        yield first
    async for chunk in session:
        yield chunk
