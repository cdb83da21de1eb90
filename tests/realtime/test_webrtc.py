"""WebRTC transport: its pieces (control parsing, offer checks, playout, paced track, ICE pinning), then
the real app over the tiny models with an aiortc client peer on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import aioice.ice
import av
import httpx
import numpy as np
import pytest
import pytest_asyncio
from aiortc import RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from testing import LiveServer, serve, service_config

from realtime.config import IceServer, WebRTCConfig
from realtime.session import ServiceError
from realtime.transports.audio_track import FRAME_SAMPLES, OPUS_RATE, Playout, SpeechTrack
from realtime.transports.ice import advertise_only, rtc_configuration
from realtime.transports.webrtc import (
    MAX_OFFER_BYTES,
    Cancel,
    ControlError,
    Speak,
    check_offer,
    parse_control,
)

# -- control messages ------------------------------------------------------------------------------


def test_parse_speak_and_cancel() -> None:
    assert parse_control('{"type": "speak", "text": "hi"}') == Speak(text="hi")
    full = (
        '{"type": "speak", "text": "hi", "voice": "v", "id": "a", "speed": 2, "seed": 7, "fixed_length": 9}'
    )
    assert parse_control(full) == Speak("hi", "v", "a", speed=2.0, seed=7, fixed_length=9)
    assert parse_control('{"type": "cancel"}') == Cancel()


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        (b"\x00", "binary"),
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"type": "dance"}', "unknown control message type"),
        ('{"type": "speak"}', "'text' must be a string"),
        ('{"type": "speak", "text": "  "}', "non-empty 'text'"),
        ('{"type": "speak", "text": "a", "voice": 3}', "'voice' must be a string"),
        ('{"type": "speak", "text": "a", "id": 3}', "'id' must be a string"),
        ('{"type": "speak", "text": "a", "speed": "fast"}', "'speed' must be a number"),
        ('{"type": "speak", "text": "a", "seed": 1.5}', "'seed' must be an integer"),
        ('{"type": "speak", "text": "a", "fixed_length": 0}', "'fixed_length' must be an integer from 1"),
        ('{"type": "speak", "text": "a", "fixed_length": 1000000000}', "'fixed_length' must be an integer"),
        ('{"type": "speak", "text": "a", "speed": 1e400}', "out of range"),
        ('{"type": "speak", "text": "a", "speed": NaN}', "not a number JSON allows"),
        ('{"type": "speak", "text": "a", "speed": ' + "9" * 400 + "}", "'speed' must be between"),
        ('{"type": "speak", "text": "a", "seed": ' + "9" * 40 + "}", "'seed' must be an integer from 0"),
        ('{"type": "speak", "text": "\\ud800"}', "not valid Unicode"),
        ('{"type": "speak", "text": "a", "id": "' + "x" * 200 + '"}', "'id' must have 1 to"),
        ("[" * 100_000 + "]" * 100_000, "nest at most"),
    ],
)
def test_parse_refuses_bad_messages(message: str | bytes, fragment: str) -> None:
    with pytest.raises(ControlError, match=fragment):
        parse_control(message)


# -- offers ------------------------------------------------------------------------------------------

_OFFER_HEAD = "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"
_AUDIO = "m=audio 9 UDP/TLS/RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\na=ice-ufrag:abcd\r\na=ice-pwd:{pwd}\r\n"
_APPLICATION = "m=application 9 UDP/DTLS/SCTP webrtc-datachannel\r\nc=IN IP4 0.0.0.0\r\n"


@pytest.mark.parametrize(
    ("sdp", "fragment"),
    [
        ("garbage", "not valid SDP"),
        (_OFFER_HEAD + "m=audio x\r\n", "not valid SDP"),
        (_OFFER_HEAD + _APPLICATION, "audio m-line"),
        (_OFFER_HEAD + _AUDIO.format(pwd="p" * 22), "data channel"),
        (_OFFER_HEAD + _AUDIO.format(pwd="p" * 22) + _APPLICATION, "ICE credentials"),
    ],
)
def test_check_offer_refuses(sdp: str, fragment: str) -> None:
    with pytest.raises(ServiceError, match=fragment) as caught:
        check_offer(sdp)
    assert caught.value.code == "bad_offer"
    assert caught.value.http_status == 400


# -- playout -----------------------------------------------------------------------------------------


def _ramp(n: int, start: int = 1) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int16)


async def test_playout_reads_in_order_and_pads_with_silence() -> None:
    playout = Playout(capacity=10 * FRAME_SAMPLES)
    await playout.write(_ramp(5))
    await playout.write(_ramp(3, start=6))
    assert playout.read(4).tolist() == [1, 2, 3, 4]
    assert playout.read(6).tolist() == [5, 6, 7, 8, 0, 0]
    assert (playout.written, playout.played) == (8, 8)
    assert not playout.read(3).any()


async def test_playout_reports_positions_and_clear_reaches_them() -> None:
    playout = Playout(capacity=10 * FRAME_SAMPLES)
    await playout.write(_ramp(10))
    first = playout.when_played(1)
    end = playout.when_played(playout.written)
    playout.read(1)
    await asyncio.sleep(0)
    assert first.done() and not end.done()
    playout.clear()
    assert end.done()
    assert playout.played == playout.written == 10
    assert not playout.read(4).any()


async def test_playout_throttles_the_writer_at_capacity() -> None:
    playout = Playout(capacity=FRAME_SAMPLES)
    await playout.write(_ramp(FRAME_SAMPLES))
    blocked = asyncio.create_task(playout.write(_ramp(10)))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    playout.read(FRAME_SAMPLES // 2)
    await asyncio.wait_for(blocked, 1.0)
    assert playout.written == FRAME_SAMPLES + 10


async def test_playout_takes_int16_mono_only() -> None:
    playout = Playout(capacity=FRAME_SAMPLES)
    with pytest.raises(ValueError, match="int16"):
        await playout.write(np.zeros(4, dtype=np.float32))


# -- paced track -------------------------------------------------------------------------------------


class _ManualClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_track_frames_are_20ms_s16_mono_48k_with_contiguous_pts() -> None:
    playout = Playout(capacity=4 * FRAME_SAMPLES)
    clock = _ManualClock()
    track = SpeechTrack(playout, clock=clock)
    await playout.write(np.full(FRAME_SAMPLES + 10, 1000, dtype=np.int16))
    frames = []
    for _ in range(3):
        frames.append(await track.recv())
        clock.now += FRAME_SAMPLES / OPUS_RATE  # exactly on time: no sleep needed
    assert [f.pts for f in frames] == [0, FRAME_SAMPLES, 2 * FRAME_SAMPLES]
    for frame in frames:
        assert (frame.sample_rate, frame.samples, frame.format.name, frame.layout.name) == (
            OPUS_RATE,
            FRAME_SAMPLES,
            "s16",
            "mono",
        )
        assert frame.time_base == Fraction(1, OPUS_RATE)
    samples = [f.to_ndarray()[0] for f in frames]
    assert (samples[0] == 1000).all()
    assert (samples[1][:10] == 1000).all() and not samples[1][10:].any()
    assert not samples[2].any()


async def test_track_restarts_its_clock_after_a_stall_instead_of_bursting() -> None:
    playout = Playout(capacity=FRAME_SAMPLES)
    clock = _ManualClock()
    track = SpeechTrack(playout, clock=clock)
    await track.recv()
    clock.now += 5.0  # the loop stalled for 5 s
    await track.recv()
    clock.now += 0.001  # 1 ms later the next frame is not due yet: recv must wait, not catch up
    pending = asyncio.create_task(track.recv())
    await asyncio.sleep(0.005)
    assert not pending.done()
    pending.cancel()
    track.stop()


# -- ICE policy --------------------------------------------------------------------------------------


def test_advertise_only_pins_addresses_inside_the_block_only() -> None:
    with advertise_only(("127.0.0.1", "::1")):
        assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False) == ["127.0.0.1"]
        assert aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=True) == ["127.0.0.1", "::1"]
    # Outside the block aioice's own lookup answers, which never lists IPv4 loopback.
    assert "127.0.0.1" not in aioice.ice.get_host_addresses(use_ipv4=True, use_ipv6=False)


def test_ice_configuration_validates_and_never_uses_the_default_stun_server() -> None:
    assert rtc_configuration(WebRTCConfig().ice_servers).iceServers == []
    servers = rtc_configuration((IceServer("turn:turn.example:3478", "u", "p"),)).iceServers
    assert servers is not None and [s.urls for s in servers] == ["turn:turn.example:3478"]
    with pytest.raises(ValueError, match="IP address"):
        WebRTCConfig(host_addresses=("localhost",))
    with pytest.raises(ValueError, match="empty"):
        WebRTCConfig(host_addresses=())
    with pytest.raises(ValueError, match="must start with"):
        IceServer("http://stun.example")
    with pytest.raises(ValueError, match="username"):
        IceServer("turn:turn.example")


# -- end to end: the real app, the tiny models, an aiortc peer on loopback ------------------------------

END_TO_END = pytest.mark.asyncio(loop_scope="session")
EVENT_TIMEOUT_S = 60.0
# One second of speech per sentence (25 speech tokens), and one far longer than any test waits for.
SHORT, LONG = 25, 1500


LOOPBACK = "127.0.0.1"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def live(tiny_models: Path, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[LiveServer]:
    """A server of its own: few sessions, a short connect deadline, media on loopback only."""
    webrtc = WebRTCConfig(max_sessions=2, connect_timeout_s=2.0, host_addresses=(LOOPBACK,))
    async with serve(service_config(tiny_models, tmp_path_factory.mktemp("voices"), webrtc=webrtc)) as server:
        yield server


@pytest_asyncio.fixture(loop_scope="session")
async def http(live: LiveServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=live.http_url) as client:
        yield client


class Peer:
    """A browser stand-in: receive-only audio, a "control" data channel, candidates on loopback only."""

    def __init__(self) -> None:
        self.pc = RTCPeerConnection(rtc_configuration(()))
        self.pc.addTransceiver("audio", direction="recvonly")
        self.channel = self.pc.createDataChannel("control")
        self.session_id = ""
        self.events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.channel.on("message", lambda message: self.events.put_nowait(json.loads(message)))
        self.frame_shapes: set[tuple[int, int]] = set()
        self.peak = 0
        self._puller: asyncio.Task[None] | None = None
        self.pc.on("track", self._on_track)

    async def offer(self, http: httpx.AsyncClient) -> httpx.Response:
        with advertise_only((LOOPBACK,)):
            await self.pc.setLocalDescription(await self.pc.createOffer())
        response = await http.post(
            "/v1/webrtc/offer", json={"sdp": self.pc.localDescription.sdp, "type": "offer"}
        )
        if response.status_code == 200:
            self.session_id = response.json()["session_id"]
        return response

    async def connect(self, http: httpx.AsyncClient) -> None:
        answer = (await self.offer(http)).json()
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer["sdp"], type=answer["type"]))
        if self.channel.readyState != "open":
            opened = asyncio.Event()
            self.channel.on("open", opened.set)
            await asyncio.wait_for(opened.wait(), EVENT_TIMEOUT_S)

    def send(self, **message: Any) -> None:
        self.channel.send(json.dumps(message))

    async def expect(self, kind: str, utterance_id: str | None = None) -> dict[str, Any]:
        """The next event, which must be of ``kind`` (and about ``utterance_id`` when given)."""
        event = await asyncio.wait_for(self.events.get(), EVENT_TIMEOUT_S)
        assert event["type"] == kind, event
        if utterance_id is not None:
            assert event["id"] == utterance_id, event
        return event

    async def close(self) -> None:
        await self.pc.close()
        if self._puller is not None:
            await self._puller

    def _on_track(self, track: MediaStreamTrack) -> None:
        self._puller = asyncio.create_task(self._pull(track))

    async def _pull(self, track: MediaStreamTrack) -> None:
        """Decode every frame the server sends, noting their layout and the loudest sample."""
        try:
            while True:
                frame = await track.recv()
                assert isinstance(frame, av.AudioFrame)
                self.frame_shapes.add((frame.sample_rate, frame.samples))
                self.peak = max(self.peak, int(np.abs(frame.to_ndarray()).max()))
        except MediaStreamError:
            return


@pytest_asyncio.fixture(loop_scope="session")
async def peer(http: httpx.AsyncClient) -> AsyncIterator[Peer]:
    client = Peer()
    await client.connect(http)
    yield client
    await client.close()


async def _eventually(condition: Any, what: str) -> None:
    for _ in range(int(EVENT_TIMEOUT_S / 0.05)):
        if await condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"never happened: {what}")


async def _session_gone(http: httpx.AsyncClient, session_id: str) -> bool:
    # DELETE closes a live session, so only ask once it should be gone already.
    return (await http.delete(f"/v1/webrtc/{session_id}")).status_code == 404


@END_TO_END
async def test_speak_streams_opus_frames_and_reports_progress(peer: Peer) -> None:
    peer.send(type="speak", text="Hello there.", id="u1", seed=1, fixed_length=SHORT)
    await peer.expect("started", "u1")
    first = await peer.expect("first_audio", "u1")
    assert first["latency_ms"] > 0
    done = await peer.expect("done", "u1")
    assert done["cancelled"] is False
    assert peer.frame_shapes == {(48_000, 960)}
    assert peer.peak > 100, "the decoded audio is silent"


@END_TO_END
async def test_cancel_stops_at_once_and_frees_the_engine(live: LiveServer, peer: Peer) -> None:
    peer.send(type="speak", text="A very long story.", seed=1, fixed_length=LONG)
    await peer.expect("started")
    await peer.expect("first_audio")
    assert live.runtime.stats().active_streams == 1
    peer.send(type="cancel")
    assert (await peer.expect("done"))["cancelled"] is True
    assert live.runtime.stats().active_streams == 0


@END_TO_END
async def test_a_new_speak_barges_in(live: LiveServer, peer: Peer) -> None:
    peer.send(type="speak", text="A very long story.", id="long", seed=1, fixed_length=LONG)
    await peer.expect("started", "long")
    await peer.expect("first_audio", "long")
    peer.send(type="speak", text="Short.", id="short", seed=2, fixed_length=SHORT)
    assert (await peer.expect("done", "long"))["cancelled"] is True
    await peer.expect("started", "short")
    await peer.expect("first_audio", "short")
    assert (await peer.expect("done", "short"))["cancelled"] is False
    assert live.runtime.stats().active_streams == 0


@END_TO_END
async def test_bad_messages_and_unknown_voices_are_reported_on_the_channel(peer: Peer) -> None:
    peer.send(type="dance")
    error = await peer.expect("error")
    assert error["code"] == "bad_message" and "dance" in error["message"]
    peer.send(type="speak", text="Hello.", voice="nobody", id="v")
    await peer.expect("started", "v")
    assert (await peer.expect("error", "v"))["code"] == "voice_not_found"


@END_TO_END
async def test_signalling_refuses_bad_offers_with_a_json_error(http: httpx.AsyncClient) -> None:
    for body in ({"sdp": "garbage", "type": "offer"}, {"sdp": 3, "type": "offer"}, [1, 2]):
        response = await http.post("/v1/webrtc/offer", json=body)
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "bad_offer"
        assert response.json()["error"]["message"]
    response = await http.post("/v1/webrtc/offer", content=b"{not json")
    assert response.status_code == 400 and response.json()["error"]["code"] == "bad_offer"
    response = await http.delete("/v1/webrtc/no-such-session")
    assert response.status_code == 404 and response.json()["error"]["code"] == "unknown_session"


@END_TO_END
async def test_signalling_refuses_oversized_offers(http: httpx.AsyncClient) -> None:
    too_large = json.dumps({"sdp": "x" * MAX_OFFER_BYTES, "type": "offer"})
    response = await http.post("/v1/webrtc/offer", content=too_large)
    assert response.status_code == 413 and response.json()["error"]["code"] == "body_too_large"


@END_TO_END
async def test_sessions_are_bounded_and_unconnected_ones_expire(http: httpx.AsyncClient) -> None:
    peers = [Peer() for _ in range(3)]
    try:
        first, second = [await p.offer(http) for p in peers[:2]]
        assert first.status_code == second.status_code == 200
        refused = await peers[2].offer(http)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "too_many_sessions"
        assert (await http.delete(f"/v1/webrtc/{peers[0].session_id}")).status_code == 204
        # The second never completes ICE, so the server closes it after connect_timeout_s.
        await _eventually(lambda: _session_gone(http, peers[1].session_id), "the unconnected session closed")
    finally:
        for p in peers:
            await p.close()


@END_TO_END
async def test_the_server_survives_a_peer_that_vanishes(
    live: LiveServer, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RFC 7675 consent checks notice a silent peer; shorten them so the test does not wait ~30 s.
    monkeypatch.setattr(aioice.ice, "CONSENT_INTERVAL", 0.2)
    monkeypatch.setattr(aioice.ice, "CONSENT_FAILURES", 3)
    gone = Peer()
    await gone.connect(http)
    gone.send(type="speak", text="A very long story.", seed=1, fixed_length=LONG)
    await gone.expect("started")
    await gone.expect("first_audio")
    # Stop its ICE transport: no DTLS close, no DELETE, its sockets simply go quiet.
    assert gone.pc.sctp is not None
    await gone.pc.sctp.transport.transport.stop()

    async def engine_idle() -> bool:
        return live.runtime.stats().active_streams == 0

    await _eventually(engine_idle, "the vanished peer's utterance was cancelled")
    await _eventually(lambda: _session_gone(http, gone.session_id), "the vanished peer's session closed")
    await gone.close()

    fresh = Peer()
    await fresh.connect(http)
    fresh.send(type="speak", text="Still here.", seed=3, fixed_length=SHORT)
    await fresh.expect("started")
    await fresh.expect("first_audio")
    assert (await fresh.expect("done"))["cancelled"] is False
    await fresh.close()
