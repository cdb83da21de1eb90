"""The sans-I/O agents' protocol: commands in, actions out, no sockets or engines."""

from __future__ import annotations

import json

import pytest

from realtime.audio import Encoding
from realtime.protocol.core import (
    Abort,
    AgentProtocol,
    AppendText,
    AudioOut,
    CancelContext,
    Close,
    CloseContext,
    CloseSocket,
    ContextDone,
    EndContext,
    ErrorEvent,
    Flush,
    FlushDone,
    ProtocolError,
    ProtocolLimits,
    Release,
    Send,
    Speak,
    StartContext,
)
from realtime.protocol.native import NativeDialect, audio_frame, parse_audio_frame
from realtime.session import WordTiming


def protocol(**limits) -> AgentProtocol:
    return AgentProtocol(ProtocolLimits(**limits), voice_exists=lambda voice: voice in ("default", "alice"))


def spoken(actions) -> list[str]:
    return [a.text for a in actions if isinstance(a, Speak)]


def test_sentences_are_spoken_as_soon_as_complete_and_flush_speaks_the_rest():
    p = protocol()
    assert p.handle(StartContext("c")) == []
    assert spoken(p.handle(AppendText("c", "Hello wor"))) == []
    assert spoken(p.handle(AppendText("c", "ld. How"))) == ["Hello world."]
    assert spoken(p.handle(AppendText("c", " are you? Fine. And"))) == ["How are you? Fine."]
    assert spoken(p.handle(Flush("c"))) == ["And"]
    assert spoken(p.handle(Flush("c"))) == []


def sent(actions) -> list:
    return [a.event for a in actions if isinstance(a, Send)]


def test_reported_flushes_are_numbered_and_done_once_their_text_is_spoken():
    p = protocol()
    p.handle(StartContext("c"))
    # Nothing spoken or buffered: done at once.
    assert sent(p.handle(Flush("c", report=True))) == [FlushDone("c", 1)]
    assert spoken(p.handle(AppendText("c", "One. Two"))) == ["One."]
    actions = p.handle(Flush("c", report=True))
    assert spoken(actions) == ["Two"] and sent(actions) == []
    assert spoken(p.handle(Flush("c"))) == []  # not reported: not numbered
    assert spoken(p.handle(AppendText("c", "Three. "))) == ["Three."]
    assert sent(p.handle(Flush("c", report=True))) == []  # nothing buffered, "Three." still to speak
    assert sent(p.speech_done("c")) == []  # "One."
    assert sent(p.speech_done("c")) == [FlushDone("c", 2)]  # "Two", the last text before flush 2
    p.handle(AppendText("c", "Four"))
    p.handle(Flush("c", report=True))
    assert sent(p.handle(EndContext("c"))) == []
    assert sent(p.speech_done("c")) == [FlushDone("c", 3)]  # "Three."
    # The last flush is reported before the context is done.
    assert p.speech_done("c") == [
        Send(FlushDone("c", 4)), Release("c"), Send(ContextDone("c", cancelled=False))
    ]


def test_reported_flushes_waiting_are_bounded_and_dropped_with_a_cancel():
    p = protocol(max_flushes_waiting=1)
    p.handle(StartContext("c"))
    p.handle(AppendText("c", "One"))
    assert spoken(p.handle(Flush("c", report=True))) == ["One"]
    p.handle(AppendText("c", "Two"))
    with pytest.raises(ProtocolError) as refused:
        p.handle(Flush("c", report=True))
    assert refused.value.code == "queue_full"
    assert spoken(p.handle(Flush("c"))) == ["Two"]  # the refused flush spoke nothing
    assert sent(p.handle(CancelContext("c"))) == [ContextDone("c", cancelled=True)]
    assert p.speech_done("c") == []


def test_end_finishes_once_every_speak_is_done():
    p = protocol()
    p.handle(StartContext("c"))
    p.handle(AppendText("c", "One. Two"))
    assert spoken(p.handle(EndContext("c"))) == ["Two"]
    assert p.speech_done("c") == []
    assert p.speech_done("c") == [Release("c"), Send(ContextDone("c", cancelled=False))]
    assert not p.has_context("c")


def test_end_with_nothing_pending_is_done_at_once():
    p = protocol()
    p.handle(StartContext("c"))
    assert p.handle(EndContext("c")) == [Release("c"), Send(ContextDone("c", cancelled=False))]


def test_cancel_aborts_and_acknowledges_and_late_reports_are_ignored():
    p = protocol()
    p.handle(StartContext("c"))
    p.handle(AppendText("c", "Speaking now. "))
    assert p.handle(CancelContext("c")) == [Abort("c"), Send(ContextDone("c", cancelled=True))]
    assert p.speech_done("c") == []
    assert p.speech_failed("c", "busy", "x") == []


def test_failure_ends_the_context_with_an_error():
    p = protocol()
    p.handle(StartContext("c"))
    p.handle(AppendText("c", "Hi. "))
    assert p.speech_failed("c", "busy", "full") == [Abort("c"), Send(ErrorEvent("busy", "full", "c"))]
    assert not p.has_context("c")


def test_close_aborts_every_context():
    p = protocol()
    p.handle(StartContext("a"))
    p.handle(StartContext("b"))
    assert p.handle(CloseSocket()) == [Abort("a"), Abort("b"), Close()]


@pytest.mark.parametrize(
    ("command", "code"),
    [
        (StartContext("c", voice="nobody"), "voice_not_found"),
        (StartContext("c", sample_rate=11025), "unsupported_sample_rate"),
        (StartContext("c", speed=5.0), "invalid_speed"),
        (StartContext("has space"), "invalid_context_id"),
        (StartContext("x" * 65), "invalid_context_id"),
        (AppendText("ghost", "hi"), "unknown_context"),
        (Flush("ghost"), "unknown_context"),
        (CancelContext("ghost"), "unknown_context"),
    ],
)
def test_refusals(command, code):
    with pytest.raises(ProtocolError) as info:
        protocol().handle(command)
    assert info.value.code == code and info.value.message


def test_limits_on_contexts_and_pending_text_and_ended_contexts():
    p = protocol(max_contexts=1, max_pending_chars=10)
    p.handle(StartContext("a"))
    with pytest.raises(ProtocolError, match="already open"):
        p.handle(StartContext("a"))
    with pytest.raises(ProtocolError) as info:
        p.handle(StartContext("b"))
    assert info.value.code == "too_many_contexts"
    p.handle(AppendText("a", "12345"))
    with pytest.raises(ProtocolError) as info:
        p.handle(AppendText("a", "678901"))
    assert info.value.code == "text_too_long"
    p.handle(AppendText("a", ". "))  # the speak in flight still counts until done
    with pytest.raises(ProtocolError):
        p.handle(AppendText("a", "abcd"))
    p.speech_done("a")
    p.handle(AppendText("a", "abcd"))
    p.handle(EndContext("a"))
    with pytest.raises(ProtocolError) as info:
        p.handle(AppendText("a", "more"))
    assert info.value.code == "context_ended"


def test_native_dialect_decodes_messages():
    d, p = NativeDialect(), protocol()
    start = json.dumps(
        {
            "type": "start",
            "context_id": "c",
            "voice": "alice",
            "sample_rate": 8000,
            "encoding": "mulaw",
            "speed": 1.5,
            "seed": 4,
        }
    )
    assert d.decode(start, p) == [StartContext("c", "alice", 8000, Encoding.MULAW, 1.5, 4)]
    assert d.decode('{"type": "text", "context_id": "c", "text": "hi"}', p) == [AppendText("c", "hi")]
    assert d.decode('{"type": "end", "context_id": "c"}', p) == [EndContext("c")]
    assert d.decode('{"type": "close"}', p) == [CloseSocket()]


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        ("{oops", "invalid_json"),
        ("[1, 2]", "invalid_message"),
        ('{"type": "sing", "context_id": "c"}', "unknown_type"),
        ('{"type": "text", "text": "hi"}', "invalid_message"),
        ('{"type": "text", "context_id": "c", "text": 5}', "invalid_message"),
        ('{"type": "start", "context_id": "c", "sample_rate": true}', "invalid_message"),
        ('{"type": "start", "context_id": "c", "encoding": "opus"}', "unsupported_encoding"),
        (b"\x01\x02", "binary_not_accepted"),
    ],
)
def test_native_dialect_refuses_bad_frames(frame, code):
    with pytest.raises(ProtocolError) as info:
        NativeDialect().decode(frame, protocol())
    assert info.value.code == code


def test_audio_frames_round_trip_and_carry_metadata():
    assert parse_audio_frame(audio_frame("ctx-1", 7, b"\x01\x02\x03")) == ("ctx-1", 7, b"\x01\x02\x03")
    with pytest.raises(ValueError):
        parse_audio_frame(b"\x02\x00")
    out = AudioOut("c", 3, b"ab", 1.0, 0.5, (WordTiming("hi", 1.0, 1.2, True),), True)
    binary, meta = NativeDialect().encode(out)
    assert parse_audio_frame(binary) == ("c", 3, b"ab")
    assert json.loads(meta) == {
        "type": "chunk",
        "context_id": "c",
        "seq": 3,
        "start_s": 1.0,
        "duration_s": 0.5,
        "words": [{"word": "hi", "start_s": 1.0, "end_s": 1.2, "estimated": True}],
        "final": True,
    }
    assert json.loads(NativeDialect().encode(ErrorEvent("x", "y"))[0]) == {
        "type": "error",
        "context_id": None,
        "code": "x",
        "message": "y",
    }


def test_close_context_speaks_what_was_flushed_and_drops_the_rest():
    p = protocol()
    p.handle(StartContext("c"))
    assert spoken(p.handle(AppendText("c", "Flushed words"))) == []
    assert spoken(p.handle(Flush("c"))) == ["Flushed words"]
    p.handle(AppendText("c", "never flushed"))
    assert p.handle(CloseContext("c")) == []  # still speaking
    assert p.speech_done("c") == [Release("c"), Send(ContextDone("c", cancelled=False))]
    assert not p.has_context("c")


def test_closing_a_closing_context_cancels_it():
    p = protocol()
    p.handle(StartContext("c"))
    p.handle(AppendText("c", "Long sentence."))
    p.handle(AppendText("c", " "))
    assert p.handle(CloseContext("c")) == []
    assert p.handle(CloseContext("c")) == [Abort("c"), Send(ContextDone("c", cancelled=True))]
    assert p.speech_done("c") == []


def test_draining_close_socket_waits_for_flushed_contexts():
    p = protocol()
    for cid in ("a", "b"):
        p.handle(StartContext(cid))
    p.handle(AppendText("a", "Speaking now. "))
    p.handle(AppendText("b", "unflushed"))
    # b had nothing in flight: done at once; a finishes first, then the socket closes.
    assert p.handle(CloseSocket(drain=True)) == [Release("b"), Send(ContextDone("b", cancelled=False))]
    with pytest.raises(ProtocolError) as refused:
        p.handle(AppendText("a", "more"))
    assert refused.value.code == "socket_closing"
    assert p.speech_done("a") == [Release("a"), Send(ContextDone("a", cancelled=False)), Close()]

