"""WebRTC transport: HTTP signalling, one peer connection per browser, speech as an Opus track.

Signalling (same port as the rest of the API):

- ``POST /v1/webrtc/offer`` with ``{"sdp", "type": "offer"}`` answers ``{"sdp", "type": "answer",
  "session_id"}``. The offer must carry an audio m-line (the browser receives; ``recvonly`` is enough)
  and a data channel. No trickle ICE: the answer holds all of the server's candidates, and the browser
  should send its offer after its own gathering completes. A body over 64 KiB is refused (413,
  ``body_too_large``).
- ``DELETE /v1/webrtc/{session_id}`` closes a session.

Control runs on the data channel the browser opens (any label; ``"control"`` by convention), as JSON
text messages:

- ``{"type": "speak", "text", "voice"?, "id"?, "speed"?, "seed"?, "fixed_length"?, "instructions"?,
  "language"?, "mode"?}`` starts an
  utterance. A new speak *barges in*: the current utterance is cancelled, its queued audio dropped,
  and the new one starts after it has released its engine slot. ``id`` (a string of the client's
  choosing; the server numbers them when absent) is echoed in every event about that utterance.
  ``speed``, ``seed``, ``fixed_length``, ``instructions``, ``language`` and ``mode`` mean what they
  mean in the websocket protocol's ``start``.
- ``{"type": "cancel"}`` stops the current utterance at once.

Events back: ``{"type": "started", "id"}``; ``{"type": "first_audio", "id", "latency_ms"}`` when the
first frame with speech is handed to the encoder (latency from the speak message's arrival);
then exactly one of ``{"type": "done", "id", "cancelled"}`` (after the last sample has been sent, or at
cancellation) or ``{"type": "error", "id", "code", "message"}``. Malformed control messages get an
``error`` event without ``id``.

A session ends when the peer goes away (the connection turns ``failed`` or ``closed``: a DTLS close, or
ICE consent checks unanswered), when no connection comes up within ``connect_timeout_s`` of the answer,
on DELETE, or at shutdown; ending cancels its utterance, which frees its engine slot.

Offers without a DTLS fingerprint are refused (400 `bad_offer`). A client may hold at most
`limits.pending_offers_per_client` sessions answered and not yet connected (429
`too_many_pending_offers`), so offers that never connect cannot lock other clients out.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.sdp import SessionDescription
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engines.llm.base import PromptMode, SamplingParams
from realtime import validation
from realtime.audio import Resampler, to_pcm16
from realtime.config import WebRTCConfig
from realtime.limits import Slots
from realtime.runtime import Runtime
from realtime.session import ServiceError, SpeechRequest
from realtime.transports.audio_track import OPUS_RATE, Playout, SpeechTrack
from realtime.transports.body import read_body
from realtime.transports.http import error_response, principal_of
from realtime.transports.ice import advertise_only, rtc_configuration
from realtime.validation import InvalidInput

logger = logging.getLogger(__name__)

MAX_OFFER_BYTES = 64 * 1024
MAX_UTTERANCE_ID_CHARS = 128
# How long a cancelled utterance may take to release its engine slot before the next one starts anyway.
CANCEL_TIMEOUT_S = 2.0


class ControlError(Exception):
    """A data-channel message that is not a valid command."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(frozen=True)
class Speak:
    text: str
    voice: str = "default"
    id: str | None = None
    speed: float = 1.0
    seed: int | None = None
    fixed_length: int | None = None
    instructions: str | None = None
    language: str | None = None
    mode: PromptMode | None = None

    def request(self) -> SpeechRequest:
        sampling = SamplingParams(seed=self.seed, fixed_length=self.fixed_length)
        return SpeechRequest(text=self.text, voice=self.voice, sampling=sampling, speed=self.speed,
                             instructions=self.instructions, language=self.language, mode=self.mode)


@dataclass(frozen=True)
class Cancel:
    pass


def parse_control(message: str | bytes) -> Speak | Cancel:
    """Decode one data-channel message into a command; :class:`ControlError` says what is wrong."""
    if isinstance(message, bytes):
        raise ControlError("control messages are JSON text, not binary")
    try:
        body = validation.parse_json(message)
    except InvalidInput as exc:
        raise ControlError(f"control message: {exc.message}") from None
    if not isinstance(body, dict):
        raise ControlError("control message must be a JSON object")
    kind = body.get("type")
    if kind == "cancel":
        return Cancel()
    if kind != "speak":
        kind_shown = kind if isinstance(kind, str | int | float | None) else type(kind).__name__
        raise ControlError(f"unknown control message type {kind_shown!r}; expected 'speak' or 'cancel'")
    try:
        text = validation.text(body.get("text"), "text")
        voice = validation.text(body.get("voice", "default"), "voice")
        utterance_id = body.get("id")
        if utterance_id is not None:
            utterance_id = validation.text(utterance_id, "id")
            if not 1 <= len(utterance_id) <= MAX_UTTERANCE_ID_CHARS:
                raise ControlError(f"speak 'id' must have 1 to {MAX_UTTERANCE_ID_CHARS} characters")
        speed = validation.speed(body.get("speed", 1.0))
        seed = validation.seed(body.get("seed"))
        fixed_length = validation.fixed_length(body.get("fixed_length"))
    except InvalidInput as exc:
        raise ControlError(f"speak: {exc.message}") from None
    if not text.strip():
        raise ControlError("speak needs a non-empty 'text' string")
    style = [body.get(name) for name in ("instructions", "language", "mode")]
    valid = [value is None or (isinstance(value, str) and validation.is_valid_text(value)) for value in style]
    if not all(valid):
        raise ControlError("speak 'instructions', 'language' and 'mode' must be strings of valid Unicode")
    instructions, language, mode = style
    if mode is not None and mode not in set(PromptMode):
        raise ControlError(f"speak 'mode' must be one of {', '.join(PromptMode)}")
    return Speak(text, voice, utterance_id, speed, seed, fixed_length, instructions, language,
                 PromptMode(mode) if mode is not None else None)


def check_offer(sdp: str) -> None:
    """Refuse offers this transport cannot answer, before any peer connection is made."""
    try:
        description = SessionDescription.parse(sdp)
    except Exception:
        # aiortc's SDP parser reports malformed lines through asserts, lookups and conversions.
        raise ServiceError("bad_offer", "the offer is not valid SDP", 400) from None
    kinds = [media.kind for media in description.media]
    if not kinds:
        raise ServiceError("bad_offer", "the offer is not valid SDP: it has no media sections", 400)
    if "audio" not in kinds:
        raise ServiceError("bad_offer", "the offer needs an audio m-line to receive speech on", 400)
    if "application" not in kinds:
        raise ServiceError("bad_offer", "the offer needs a data channel for control messages", 400)
    if any(
        media.ice is None or media.ice.usernameFragment is None or media.ice.password is None
        for media in description.media
    ):
        raise ServiceError("bad_offer", "the offer has no ICE credentials (ice-ufrag/ice-pwd)", 400)
    if any(media.dtls is None or not media.dtls.fingerprints for media in description.media):
        raise ServiceError("bad_offer", "the offer has no DTLS fingerprint (a=fingerprint)", 400)


class WebRTCSession:
    """One browser peer: its peer connection, outgoing speech track, control channel, one utterance.

    Owns every task it starts (the utterance, the connection watchdog, its own teardown) and cancels
    them when it ends; ``on_closed`` is called once, when the session has ended.
    """

    def __init__(
        self,
        session_id: str,
        runtime: Runtime,
        config: WebRTCConfig,
        on_closed: Callable[[str], None],
        on_settled: Callable[[], None] = lambda: None,
    ) -> None:
        self.id = session_id
        self._runtime = runtime
        self._config = config
        self._on_closed = on_closed
        # Called once, when the connection comes up or the session ends, whichever is first.
        self._on_settled: Callable[[], None] | None = on_settled
        self._pc = RTCPeerConnection(rtc_configuration(config.ice_servers))
        self._playout = Playout(capacity=int(config.playout_buffer_s * OPUS_RATE))
        self._track = SpeechTrack(self._playout)
        self._channel: RTCDataChannel | None = None
        self._utterance: asyncio.Task[None] | None = None
        self._utterance_count = 0
        self._watchdog: asyncio.Task[None] | None = None
        self._teardown: asyncio.Task[None] | None = None
        self._pc.on("datachannel", self._on_datachannel)
        self._pc.on("connectionstatechange", self._on_connection_state)

    async def answer(self, offer: RTCSessionDescription) -> RTCSessionDescription:
        """Apply the browser's offer and return the complete answer (all local candidates gathered)."""
        try:
            await self._pc.setRemoteDescription(offer)
        except Exception as exc:  # aiortc refuses what it cannot negotiate in several ways
            raise ServiceError("bad_offer", f"the offer was refused: {exc}", 400) from None
        self._pc.addTrack(self._track)
        with advertise_only(self._config.host_addresses):
            await self._pc.setLocalDescription(await self._pc.createAnswer())
        self._watchdog = asyncio.create_task(self._close_unless_connected(self._config.connect_timeout_s))
        return self._pc.localDescription

    @property
    def utterance(self) -> asyncio.Task[None] | None:
        """The utterance being spoken, if any."""
        task = self._utterance
        return task if task is not None and not task.done() else None

    async def close(self) -> None:
        """End the session and return once it has ended; safe to call again, from any task."""
        await asyncio.shield(self._begin_close())

    def _begin_close(self) -> asyncio.Task[None]:
        if self._teardown is None:
            self._teardown = asyncio.create_task(self._end())
        return self._teardown

    async def _end(self) -> None:
        """Cancel the utterance and the watchdog, close the peer connection, tell the owner."""
        # No events during teardown: aiortc fails sends on a dead transport in a task nobody awaits.
        self._channel = None
        tasks = [task for task in (self._utterance, self._watchdog) if task is not None]
        for task in tasks:
            task.cancel()
        self._playout.clear()
        if tasks:
            await asyncio.wait(tasks, timeout=CANCEL_TIMEOUT_S)
        try:
            self._track.stop()
            await self._pc.close()
        finally:
            logger.info("webrtc %s: closed", self.id)
            self._settle()
            self._on_closed(self.id)

    def _settle(self) -> None:
        settled, self._on_settled = self._on_settled, None
        if settled is not None:
            settled()

    def _on_connection_state(self) -> None:
        # aiortc has no "disconnected" state: a vanished peer fails its ICE consent checks (RFC 7675),
        # which closes the ICE transport and moves the connection to "closed".
        state = self._pc.connectionState
        logger.info("webrtc %s: connection %s", self.id, state)
        if state == "connected":
            self._settle()
            if self._watchdog is not None:
                self._watchdog.cancel()
                self._watchdog = None
        elif state in ("failed", "closed"):
            self._begin_close()

    async def _close_unless_connected(self, timeout_s: float) -> None:
        await asyncio.sleep(timeout_s)
        logger.info("webrtc %s: no connection within %.1f s", self.id, timeout_s)
        await self.close()

    def _on_datachannel(self, channel: RTCDataChannel) -> None:
        if self._teardown is not None:
            return
        if self._channel is not None:
            logger.info("webrtc %s: ignoring extra data channel", self.id)
            return
        self._channel = channel
        channel.on("message", self._on_message)

    def _on_message(self, message: str | bytes) -> None:
        if self._teardown is not None:
            return
        try:
            command = parse_control(message)
        except ControlError as exc:
            self._runtime.metrics.error("bad_message")
            self._send({"type": "error", "code": "bad_message", "message": exc.message})
            return
        previous = self._cancel_utterance()
        if isinstance(command, Speak):
            self._utterance_count += 1
            utterance_id = command.id if command.id is not None else str(self._utterance_count)
            self._utterance = asyncio.create_task(self._speak(command, utterance_id, previous))

    def _cancel_utterance(self) -> asyncio.Task[None] | None:
        """Cancel the running utterance and drop its queued audio now; return it if it was running."""
        task, self._utterance = self._utterance, None
        if task is None or task.done():
            return None
        task.cancel()
        self._playout.clear()
        return task

    async def _speak(self, command: Speak, utterance_id: str, previous: asyncio.Task[None] | None) -> None:
        """Stream one utterance into the playout; report its progress on the data channel."""
        received = asyncio.get_running_loop().time()
        first_audio: asyncio.Future[None] | None = None
        try:
            if previous is not None:
                await asyncio.wait([previous], timeout=CANCEL_TIMEOUT_S)
            self._send({"type": "started", "id": utterance_id})
            resampler = Resampler(OPUS_RATE)
            stream = await self._runtime.open_session(command.request())
            try:
                async for chunk in stream:
                    samples = to_pcm16(resampler.process(chunk.pcm))
                    if first_audio is None and samples.size:
                        first_audio = self._report_first_audio(utterance_id, received)
                    await self._playout.write(samples)
            finally:
                # Frees the engine slot at once, also when this task is cancelled.
                await stream.aclose()
            await self._playout.write(to_pcm16(resampler.flush()))
            await self._playout.when_played(self._playout.written)
        except ServiceError as exc:
            self._send({"type": "error", "id": utterance_id, "code": exc.code, "message": exc.message})
            return
        except asyncio.CancelledError:
            self._send({"type": "done", "id": utterance_id, "cancelled": True})
            raise
        except Exception:  # a bug must not take the session down: the utterance ends with an error
            logger.exception("webrtc %s: utterance failed", self.id)
            self._runtime.metrics.error("internal_error")
            message = "the utterance failed on the server"
            self._send({"type": "error", "id": utterance_id, "code": "internal_error", "message": message})
            return
        finally:
            if first_audio is not None:
                first_audio.cancel()
        self._send({"type": "done", "id": utterance_id, "cancelled": False})

    def _report_first_audio(self, utterance_id: str, received: float) -> asyncio.Future[None]:
        """Send ``first_audio`` when the playout reaches the next sample written (the utterance's first)."""
        loop = asyncio.get_running_loop()

        def report(played: asyncio.Future[None]) -> None:
            if not played.cancelled():
                latency_ms = round((loop.time() - received) * 1000.0, 1)
                self._send({"type": "first_audio", "id": utterance_id, "latency_ms": latency_ms})

        future = self._playout.when_played(self._playout.written + 1)
        future.add_done_callback(report)
        return future

    def _send(self, event: dict[str, object]) -> None:
        channel = self._channel
        if channel is not None and channel.readyState == "open":
            channel.send(json.dumps(event))


class WebRTCGateway:
    """The signalling routes and the bounded registry of live sessions."""

    def __init__(self, runtime: Runtime, config: WebRTCConfig, pending_per_client: int = 4) -> None:
        self._runtime = runtime
        self._config = config
        self._sessions: dict[str, WebRTCSession] = {}
        # Sessions answered and not yet connected, per client: one client's offers that never connect
        # cannot take every session slot.
        self._pending = Slots(pending_per_client)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/webrtc/offer", self._offer, methods=["POST"]),
            Route("/v1/webrtc/{session_id}", self._delete, methods=["DELETE"]),
        ]

    def __len__(self) -> int:
        return len(self._sessions)

    async def wait_idle(self) -> None:
        """Return once no session has an utterance running (a drain lets them finish)."""
        while running := [task for session in self._sessions.values() if (task := session.utterance)]:
            await asyncio.wait(running)

    async def aclose(self) -> None:
        """Close every session (at shutdown)."""
        await asyncio.gather(*(session.close() for session in list(self._sessions.values())))

    async def _offer(self, request: Request) -> Response:
        try:
            if self._runtime.draining:
                raise ServiceError("shutting_down", "the server is shutting down", 503, retry_after_s=1)
            offer = await _read_offer(request)
            check_offer(offer.sdp)
            if len(self._sessions) >= self._config.max_sessions:
                raise ServiceError(
                    "too_many_sessions",
                    f"the server already has {self._config.max_sessions} WebRTC sessions; try again later",
                    503,
                    retry_after_s=1,
                )
            client = principal_of(request)
            if not self._pending.try_acquire(client):
                raise ServiceError(
                    "too_many_pending_offers",
                    f"you already have {self._pending.limit} WebRTC sessions that have not connected; "
                    "connect or close them first",
                    429,
                    retry_after_s=1,
                )
            session = WebRTCSession(
                secrets.token_urlsafe(12),
                self._runtime,
                self._config,
                self._forget,
                on_settled=lambda: self._pending.release(client),
            )
            # Registered before the first await, so concurrent offers count against the limit.
            self._sessions[session.id] = session
            try:
                answer = await session.answer(offer)
            except BaseException:
                await session.close()
                raise
        except ServiceError as exc:
            return error_response(exc)
        logger.info("webrtc %s: answered", session.id)
        return JSONResponse({"sdp": answer.sdp, "type": answer.type, "session_id": session.id})

    async def _delete(self, request: Request) -> Response:
        session = self._sessions.get(request.path_params["session_id"])
        if session is None:
            return error_response(
                ServiceError("unknown_session", "there is no WebRTC session with this id", 404)
            )
        await session.close()
        return Response(status_code=204)

    def _forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)


async def _read_offer(request: Request) -> RTCSessionDescription:
    body = await read_body(request, MAX_OFFER_BYTES)
    try:
        payload = validation.parse_json(body)
    except InvalidInput:
        raise ServiceError("bad_offer", 'the body must be JSON: {"sdp": ..., "type": "offer"}', 400) from None
    if (
        not isinstance(payload, dict)
        or payload.get("type") != "offer"
        or not isinstance(payload.get("sdp"), str)
        or not validation.is_valid_text(payload["sdp"])
    ):
        raise ServiceError("bad_offer", 'the body must be {"sdp": <string>, "type": "offer"}', 400)
    return RTCSessionDescription(sdp=payload["sdp"], type="offer")
