"""The agents' websockets: a thin adapter between a socket, the protocol core and the runtime.

One receive loop feeds frames through the dialect into `AgentProtocol` and executes its actions at
once, so control (cancel, close) never waits behind audio. Each context has one task that speaks its
texts in order: it drains a runtime `Session`, resamples and encodes the audio and sends it, and ends
with the context (done, cancel, error). Sends are serialised per socket; a slow client slows only its
own socket's streams. Timers the socket owns: the input-streaming policy's rechecks (`Wake`), the idle
socket and idle context timeouts. On drain (SIGTERM) contexts finish their accepted text, then the
socket closes with 1001.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable

import numpy as np
from starlette.routing import BaseRoute, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from engines.llm.base import SamplingParams
from realtime.access import ApiKeys
from realtime.audio import (
    RAW_ENCODINGS,
    CodecStreamEncoder,
    Encoding,
    Resampler,
    StreamEncoder,
    chunk_encoder,
)
from realtime.protocol.cartesia import CartesiaDialect
from realtime.protocol.core import (
    Abort,
    Action,
    AgentProtocol,
    AppendText,
    AudioOut,
    Close,
    CloseSocket,
    Dialect,
    ErrorEvent,
    Event,
    ProtocolError,
    ProtocolLimits,
    Release,
    Send,
    Speak,
    StartContext,
    Wake,
)
from realtime.protocol.elevenlabs import DEFAULT_OUTPUT_FORMAT, ElevenLabsDialect
from realtime.protocol.native import NativeDialect
from realtime.runtime import Runtime
from realtime.schedule import Playback
from realtime.session import AudioChunk, ServiceError, Session, SpeechRequest, WordTiming

logger = logging.getLogger(__name__)

CANCEL_TIMEOUT_S = 2.0


class _ContextRunner:
    """One context's lifetime: speaks its texts in order and sends their audio.

    Everything the context holds (its task, text queue, sequence numbers, encoder, each session and
    its resampler) belongs to this object and goes when the context ends (done, cancel or error), not
    when the socket closes; a later context with the same id gets a new runner.
    """

    def __init__(self, connection: _Connection, start: StartContext) -> None:
        self._connection = connection
        self._start = start
        # None: the context ended; no text follows. The protocol refuses texts beyond
        # `queued_sentences` (`queue_full`) before they reach the queue; one more place for the None.
        self._texts: asyncio.Queue[str | None] = asyncio.Queue(
            connection.runtime.config.limits.queued_sentences + 1
        )
        # A text taken from the queue whose session could not open beside the one playing (`busy`): it
        # opens once that one has ended and given its stream back.
        self._deferred: str | None = None
        self._seq = 0
        self._samples_out = 0
        # The listener's timeline across the context's texts: a later text's chunks are due behind the
        # audio before it rather than first audio, which would go ahead of other contexts' first chunks.
        self._playback = Playback()
        # Ogg Opus is one stream per context (players stop at a second, chained Ogg stream); MP3 frames
        # concatenate, so each text gets an MP3 stream of its own that ends with its last chunk.
        self._opus = (
            CodecStreamEncoder("opus", start.sample_rate, start.bit_rate)
            if start.encoding is Encoding.OPUS
            else None
        )
        self._task = asyncio.create_task(self._run(), name=f"ws-context-{start.context_id}")

    def speak(self, text: str) -> None:
        self._texts.put_nowait(text)

    def finish(self) -> None:
        """The context is done (every text spoken): end the task, which frees what it holds."""
        self._texts.put_nowait(None)

    async def stop(self) -> None:
        """Cancel at once and wait (briefly) until the session has freed its engine resources."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(self._task, CANCEL_TIMEOUT_S)

    async def _run(self) -> None:
        """Drain one session after another. While one is sent, the next queued text's session is
        already synthesising (bounded by the session's own queue), so sentences follow without a gap;
        when the server has no room for that second stream, the next text opens after this one ends."""
        session: Session | None = None
        upcoming: Session | None = None
        try:
            while True:
                if upcoming is None:
                    text, self._deferred = self._deferred, None
                    if text is None:
                        text = await self._texts.get()
                    if text is None:
                        return
                    upcoming = await self._open(text)
                session, upcoming = upcoming, None
                upcoming = await self._speak(session)
                await session.aclose()
                session = None
                await self._connection.report_done(self._start.context_id)
        except ServiceError as exc:
            await self._connection.report_failure(self._start.context_id, exc.code, exc.message)
        except Exception:  # a bug must end only this context, with an error, never the socket
            logger.exception("[ws %s] context failed", self._connection.id)
            self._connection.runtime.metrics.error("internal_error")
            message = "the context failed on the server"
            await self._connection.report_failure(self._start.context_id, "internal_error", message)
        finally:
            for pending in (session, upcoming):
                if pending is not None:
                    await pending.aclose()

    async def _speak(self, session: Session) -> Session | None:
        """Send `session`'s audio; returns the next text's session if it was opened meanwhile."""
        start = self._start
        upcoming: Session | None = None
        resampler = Resampler(start.sample_rate)
        # One encoded stream per text: its last chunk carries the codec's tail.
        encoder = self._opus or chunk_encoder(start.encoding, start.sample_rate, start.bit_rate)
        offset_s = self._samples_out / start.sample_rate
        try:
            async for chunk in session:
                context_first_audio = self._samples_out == 0 and chunk.pcm.size > 0
                await self._send(chunk, resampler, encoder, offset_s)
                if context_first_audio:
                    self._connection.runtime.metrics.first_chunk_written.observe(session.since_admission())
                if upcoming is None and self._deferred is None and not self._texts.empty():
                    text = self._texts.get_nowait()
                    assert text is not None, "a context is finished only once every text is spoken"
                    try:
                        upcoming = await self._open(text)
                    except ServiceError as exc:
                        if exc.code != "busy":
                            raise
                        # No room for a second stream now (streams or device memory): the next text
                        # waits for this one's end rather than failing the text that is playing.
                        self._deferred = text
                    else:
                        upcoming.start()
        except BaseException:
            if upcoming is not None:
                await upcoming.aclose()
            raise
        return upcoming

    async def _open(self, text: str) -> Session:
        start = self._start
        sampling = SamplingParams(seed=start.seed, fixed_length=start.fixed_length)
        # Text of an open context is work accepted already: a drain lets it finish.
        return await self._connection.runtime.open_session(
            SpeechRequest(text=text, voice=start.voice, speed=start.speed, sampling=sampling,
                          instructions=start.instructions, language=start.language, mode=start.mode),
            continuing=True,
            playback=self._playback,
        )

    async def _send(
        self, chunk: AudioChunk, resampler: Resampler, encoder: StreamEncoder, offset_s: float
    ) -> None:
        start = self._start
        pcm = resampler.process(chunk.pcm)
        if chunk.final:
            pcm = np.concatenate([pcm, resampler.flush()])
        if start.encoding in RAW_ENCODINGS:
            payload = encoder.encode(pcm)
        else:  # codec work off the event loop
            payload = await asyncio.to_thread(_encode_chunk, encoder, pcm, chunk.final)
        words = tuple(
            WordTiming(w.word, w.start_s + offset_s, w.end_s + offset_s, w.estimated) for w in chunk.words
        )
        await self._connection.send(
            AudioOut(
                context_id=start.context_id,
                seq=self._seq,
                payload=payload,
                start_s=self._samples_out / start.sample_rate,
                duration_s=pcm.size / start.sample_rate,
                words=words,
                final=chunk.final,
            )
        )
        self._seq += 1
        self._samples_out += pcm.size


def _encode_chunk(encoder: StreamEncoder, pcm: np.ndarray, final: bool) -> bytes:
    """A chunk's bytes; the last chunk of a text carries everything the codec still holds."""
    data = encoder.encode(pcm)
    if not final:
        return data
    if isinstance(encoder, CodecStreamEncoder) and encoder.kind == "opus":
        return data + encoder.pad_frame()
    return data + encoder.finish()


class _Connection:
    """One socket: the protocol state, the context runners and the send lock."""

    def __init__(self, websocket: WebSocket, runtime: Runtime, dialect: Dialect) -> None:
        self.websocket = websocket
        self.runtime = runtime
        self.dialect = dialect
        self.id = runtime.new_id()
        self.protocol = AgentProtocol(
            ProtocolLimits(
                max_contexts=runtime.config.max_contexts_per_socket,
                max_pending_chars=runtime.config.max_text_chars,
                max_queued_texts=runtime.config.limits.queued_sentences,
            ),
            voice_exists=lambda voice: voice in runtime.voices,
        )
        self._runners: dict[str, _ContextRunner] = {}
        self._wakes: dict[str, asyncio.TimerHandle] = {}  # one pending policy timer per context
        self._woken: set[asyncio.Task[None]] = set()  # what fired timers do, held until done
        self._send_lock = asyncio.Lock()
        self._closed = False
        self._close_code = 1000  # 1001 (going away) once the server drains
        limits = runtime.config.limits
        self._idle_s = limits.ws_idle_timeout_s
        self._context_idle_s = limits.context_idle_timeout_s
        self._last_message = 0.0
        self._last_text: dict[str, float] = {}  # context id → when text last came for it
        # An ElevenLabs client that sent no key in its handshake sends it in its first message.
        self._awaiting_key = bool(websocket.scope.get("state", {}).get("auth_pending"))

    async def drain(self) -> None:
        """The server is going away: every open context ends once its accepted text is spoken (its
        `done` follows), new contexts and text are refused, then the socket closes with 1001."""
        if not self._closed:
            self._close_code = 1001
            await self._execute(self.protocol.handle(CloseSocket(drain=True)))

    async def abort(self) -> None:
        """The drain ran out of time: cancel what is left and close with 1001."""
        if not self._closed:
            self._close_code = 1001
            await self._execute(self.protocol.handle(CloseSocket()))

    async def serve(self) -> None:
        await self.websocket.accept()
        logger.info("[ws %s] connected", self.id)
        loop = asyncio.get_running_loop()
        self._last_message = loop.time()
        try:
            while not self._closed:
                try:
                    async with asyncio.timeout_at(self._next_deadline()):
                        message = await self.websocket.receive()
                except TimeoutError:
                    await self._expire(loop.time())
                    continue
                if message["type"] == "websocket.disconnect":
                    break
                self._last_message = loop.time()
                frame = message.get("text")
                if frame is None:
                    frame = message.get("bytes") or b""
                if self._awaiting_key and not await self._authenticate(frame):
                    break
                await self._receive(frame)
        except WebSocketDisconnect:
            pass
        finally:
            self._closed = True
            for timer in self._wakes.values():
                timer.cancel()
            self._wakes.clear()
            for woken in self._woken:
                woken.cancel()
            await asyncio.gather(*(runner.stop() for runner in self._runners.values()))
            self._runners.clear()
            logger.info("[ws %s] disconnected", self.id)

    def _next_deadline(self) -> float:
        """When the socket, or a context holding unspoken text, has been idle too long."""
        deadline = self._last_message + self._idle_s
        for context_id in self.protocol.holding_text():
            last_text = self._last_text.get(context_id, self._last_message)
            deadline = min(deadline, last_text + self._context_idle_s)
        return deadline

    async def _expire(self, now: float) -> None:
        """End contexts whose unspoken text waited too long; close the socket if it is idle."""
        for context_id in self.protocol.holding_text():
            if now - self._last_text.get(context_id, self._last_message) >= self._context_idle_s:
                self._last_text.pop(context_id, None)
                message = (
                    f"context {context_id!r} held text without a flush or an end for "
                    f"{self._context_idle_s:g} s; it was ended"
                )
                await self._execute(self.protocol.speech_failed(context_id, "context_timeout", message))
        if now - self._last_message >= self._idle_s and not self.protocol.speaking():
            await self.send(
                ErrorEvent("idle_timeout", f"no message for {self._idle_s:g} s; closing the socket")
            )
            self._closed = True
            await self.websocket.close(1008, "idle timeout")

    async def _authenticate(self, frame: str | bytes) -> bool:
        """Check the key of a first message (ElevenLabs' `xi_api_key` or `authorization`); on failure
        say so and close (1008)."""
        self._awaiting_key = False
        key: object = None
        with contextlib.suppress(ValueError):
            message = json.loads(frame)
            if isinstance(message, dict):
                key = message.get("xi_api_key") or message.get("authorization")
        if isinstance(key, str) and key.lower().startswith("bearer "):
            key = key[len("bearer ") :].strip()
        if isinstance(key, str) and ApiKeys(self.runtime.config.access.api_keys).principal(key) is not None:
            return True
        code = "missing_api_key" if key is None else "invalid_api_key"
        await self.send(ErrorEvent(code, "an API key is required: send xi-api-key or xi_api_key"))
        self._closed = True
        await self.websocket.close(1008, code)
        return False

    async def _receive(self, frame: str | bytes) -> None:
        try:
            commands = self.dialect.decode(frame, self.protocol)
            now = asyncio.get_running_loop().time()
            for command in commands:
                if isinstance(command, AppendText):
                    self._last_text[command.context_id] = now
                await self._execute(self.protocol.handle(command))
        except ProtocolError as exc:
            self.runtime.metrics.error(exc.code)
            await self.send(ErrorEvent(exc.code, exc.message, exc.context_id))
        except (WebSocketDisconnect, ConnectionError):
            raise
        except Exception:  # a bug must not drop the socket and every context on it
            logger.exception("[ws %s] message failed", self.id)
            self.runtime.metrics.error("internal_error")
            await self.send(ErrorEvent("internal_error", "the message failed on the server"))

    async def _execute(self, actions: list[Action]) -> None:
        for action in actions:
            if isinstance(action, Speak):
                # The policy looks again only where it asks to: a Wake that it still wants comes after
                # the Speak; an end or a flush speaks everything and wants none.
                self._cancel_wake(action.context.context_id)
                runner = self._runners.get(action.context.context_id)
                if runner is None:
                    runner = self._runners[action.context.context_id] = _ContextRunner(self, action.context)
                runner.speak(action.text)
            elif isinstance(action, Wake):
                self._cancel_wake(action.context_id)
                self._wakes[action.context_id] = asyncio.get_running_loop().call_later(
                    action.after_s, self._wake, action.context_id)
            elif isinstance(action, Abort):
                self._cancel_wake(action.context_id)
                self._last_text.pop(action.context_id, None)
                runner = self._runners.pop(action.context_id, None)
                if runner is not None:
                    await runner.stop()
            elif isinstance(action, Release):
                self._cancel_wake(action.context_id)
                self._last_text.pop(action.context_id, None)
                runner = self._runners.pop(action.context_id, None)
                if runner is not None:
                    runner.finish()
            elif isinstance(action, Send):
                await self.send(action.event)
            elif isinstance(action, Close):
                self._closed = True
                await self.websocket.close(self._close_code)

    def _cancel_wake(self, context_id: str) -> None:
        timer = self._wakes.pop(context_id, None)
        if timer is not None:
            timer.cancel()

    def _wake(self, context_id: str) -> None:
        # Leave the table first: the actions may schedule this context's next Wake. A timer rather than a
        # task per Wake: most never fire (the next text, or the context's end, comes first).
        self._wakes.pop(context_id, None)
        if not self._closed:
            woken = asyncio.create_task(self._woken_pace(context_id), name=f"ws-wake-{context_id}")
            self._woken.add(woken)
            woken.add_done_callback(self._woken.discard)

    async def _woken_pace(self, context_id: str) -> None:
        # The policy's answer and its actions in one step: nothing else may act on the context between
        # what it takes from the pending text and where that text goes (else a later Speak could go first,
        # or a cancelled context get a runner again).
        await self._execute(self.protocol.wake(context_id))

    async def send(self, event: Event) -> None:
        if self._closed and not isinstance(event, ErrorEvent):
            return
        async with self._send_lock:
            for frame in self.dialect.encode(event):
                if isinstance(frame, bytes):
                    await self.websocket.send_bytes(frame)
                else:
                    await self.websocket.send_text(frame)

    async def report_done(self, context_id: str) -> None:
        await self._execute(self.protocol.speech_done(context_id))

    async def report_failure(self, context_id: str, code: str, message: str) -> None:
        actions = self.protocol.speech_failed(context_id, code, message)
        # The runner reporting is the one being aborted: drop it without awaiting itself.
        self._runners.pop(context_id, None)
        await self._execute([a for a in actions if not isinstance(a, Abort)])


class WebSocketHub:
    """The open agent sockets: counted for `/metrics`, drained at shutdown."""

    def __init__(self) -> None:
        self._connections: set[_Connection] = set()
        self._none_open = asyncio.Event()
        self._none_open.set()
        self._draining = False

    def __len__(self) -> int:
        return len(self._connections)

    async def serve(self, connection: _Connection) -> None:
        if self._draining:  # the server is going away: no new sockets
            await connection.websocket.accept()
            await connection.websocket.close(1001, "the server is shutting down")
            return
        self._connections.add(connection)
        self._none_open.clear()
        try:
            await connection.serve()
        finally:
            self._connections.discard(connection)
            if not self._connections:
                self._none_open.set()

    async def drain(self) -> None:
        """Ask every socket to finish its contexts and close (`_Connection.drain`); refuse new ones."""
        self._draining = True
        for connection in list(self._connections):
            await connection.drain()

    async def wait_closed(self) -> None:
        await self._none_open.wait()

    async def abort(self) -> None:
        """Cancel and close every socket still open."""
        for connection in list(self._connections):
            await connection.abort()


def routes(runtime: Runtime, hub: WebSocketHub) -> list[BaseRoute]:
    """The websocket endpoints: the native protocol and the Cartesia and ElevenLabs dialects."""

    def endpoint(make_dialect: Callable[[WebSocket], Dialect]) -> Callable[[WebSocket], Awaitable[None]]:
        async def serve(websocket: WebSocket) -> None:
            try:
                dialect = make_dialect(websocket)
            except ProtocolError as exc:  # a bad query parameter: say why, then close
                await websocket.accept()
                await websocket.send_text(json.dumps({"error": exc.code, "message": exc.message}))
                await websocket.close(1008)
                return
            await hub.serve(_Connection(websocket, runtime, dialect))

        return serve

    def elevenlabs(multi_context: bool) -> Callable[[WebSocket], Dialect]:
        def make(websocket: WebSocket) -> Dialect:
            query = websocket.query_params
            return ElevenLabsDialect(
                websocket.path_params["voice_id"],
                query.get("output_format", DEFAULT_OUTPUT_FORMAT),
                multi_context,
                auto_mode=query.get("auto_mode", "false").lower() == "true",
                language_code=query.get("language_code"),
            )

        return make

    return [
        WebSocketRoute("/v1/ws", endpoint(lambda websocket: NativeDialect())),
        WebSocketRoute("/cartesia/tts/websocket", endpoint(lambda websocket: CartesiaDialect())),
        WebSocketRoute(
            "/v1/text-to-speech/{voice_id}/stream-input", endpoint(elevenlabs(multi_context=False))
        ),
        WebSocketRoute(
            "/v1/text-to-speech/{voice_id}/multi-stream-input", endpoint(elevenlabs(multi_context=True))
        ),
    ]
