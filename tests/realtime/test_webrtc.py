"""WebRTC transport: the pure pieces (control parsing, offer checks, playout, paced track, ICE pinning)."""

from __future__ import annotations

import asyncio

import aioice.ice
import numpy as np
import pytest

from realtime.config import IceServer, WebRTCConfig
from realtime.session import ServiceError
from realtime.transports.audio_track import FRAME_SAMPLES, OPUS_RATE, Playout, SpeechTrack
from realtime.transports.ice import advertise_only, rtc_configuration
from realtime.transports.webrtc import (
    Cancel,
    ControlError,
    Speak,
    check_offer,
    parse_control,
)

# -- control messages ------------------------------------------------------------------------------


def test_parse_speak_and_cancel() -> None:
    assert parse_control('{"type": "speak", "text": "hi"}') == Speak(text="hi", voice="default", id=None)
    assert parse_control('{"type": "speak", "text": "hi", "voice": "v", "id": "a"}') == Speak("hi", "v", "a")
    assert parse_control('{"type": "cancel"}') == Cancel()


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        (b"\x00", "binary"),
        ("{", "not valid JSON"),
        ("[1]", "JSON object"),
        ('{"type": "dance"}', "unknown control message type"),
        ('{"type": "speak"}', "non-empty 'text'"),
        ('{"type": "speak", "text": "  "}', "non-empty 'text'"),
        ('{"type": "speak", "text": "a", "voice": 3}', "'voice' must be a string"),
        ('{"type": "speak", "text": "a", "id": 3}', "'id' must be a string"),
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
        assert frame.time_base.numerator == 1 and frame.time_base.denominator == OPUS_RATE
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
