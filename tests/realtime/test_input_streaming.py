"""Input streaming: when LLM-paced text is spoken (the pure policy, and the protocol core applying it with
a clock the test advances)."""

from __future__ import annotations

import json

import pytest

from realtime.input_streaming import (
    Cut,
    Decision,
    InputStreamingDefaults,
    PendingText,
    StreamingHints,
    decide,
)
from realtime.protocol.core import (
    AgentProtocol,
    AppendText,
    EndContext,
    ProtocolError,
    ProtocolLimits,
    Speak,
    StartContext,
    Wake,
)
from realtime.protocol.native import NativeDialect

DEFAULTS = InputStreamingDefaults(max_buffer_delay_ms=3000, sentence_end_wait_ms=150, clause_min_words=5)


def pending(**fields: object) -> PendingText:
    values: dict[str, object] = {
        "chars": 10, "whole_words": 2, "clause_words": 0, "ends_with_sentence_end": False,
        "oldest_age_s": 0.0, "newest_age_s": 0.0, "idle": True, "segments_spoken": 0,
    }
    values.update(fields)
    return PendingText(**values)  # type: ignore[arg-type]


def test_policy_waits_for_more_text_and_says_when_to_look_again() -> None:
    decision = decide(pending(oldest_age_s=1.0), StreamingHints(), DEFAULTS)
    assert decision == Decision(Cut.NOTHING, recheck_after_s=pytest.approx(2.0))
    assert decide(pending(chars=0), StreamingHints(), DEFAULTS) == Decision(Cut.NOTHING)


def test_policy_speaks_each_piece_when_the_client_buffers_itself() -> None:
    assert decide(pending(), StreamingHints(max_buffer_delay_ms=0), DEFAULTS).cut is Cut.ALL


def test_policy_speaks_a_trailing_sentence_end_once_nothing_followed() -> None:
    waiting = decide(pending(ends_with_sentence_end=True, newest_age_s=0.05), StreamingHints(), DEFAULTS)
    assert waiting == Decision(Cut.NOTHING, recheck_after_s=pytest.approx(0.1))
    ended = pending(ends_with_sentence_end=True, newest_age_s=0.2)
    assert decide(ended, StreamingHints(), DEFAULTS).cut is Cut.ALL


def test_policy_speaks_a_first_clause_only_while_nothing_is_synthesised() -> None:
    assert decide(pending(clause_words=5, whole_words=6), StreamingHints(), DEFAULTS).cut is Cut.CLAUSE
    assert decide(pending(clause_words=4, whole_words=6), StreamingHints(), DEFAULTS).cut is Cut.NOTHING
    busy = pending(clause_words=8, whole_words=9, idle=False)
    assert decide(busy, StreamingHints(), DEFAULTS).cut is Cut.NOTHING
    assert decide(pending(clause_words=8), StreamingHints(clause_min_words=0), DEFAULTS).cut is Cut.NOTHING


def test_policy_honours_word_budgets_character_schedules_and_the_buffer_delay() -> None:
    assert decide(pending(whole_words=3), StreamingHints(min_words=3), DEFAULTS).cut is Cut.WORDS
    assert decide(pending(whole_words=2), StreamingHints(min_words=3), DEFAULTS).cut is Cut.NOTHING
    schedule = StreamingHints(char_schedule=(20, 50))
    assert decide(pending(chars=25, segments_spoken=0), schedule, DEFAULTS).cut is Cut.WORDS
    assert decide(pending(chars=25, segments_spoken=1), schedule, DEFAULTS).cut is Cut.NOTHING
    assert decide(pending(chars=60, segments_spoken=7), schedule, DEFAULTS).cut is Cut.WORDS  # last repeats
    assert decide(pending(oldest_age_s=3.0), StreamingHints(), DEFAULTS).cut is Cut.WORDS
    assert decide(pending(oldest_age_s=3.0, whole_words=0), StreamingHints(), DEFAULTS).cut is Cut.ALL
    short_delay = StreamingHints(max_buffer_delay_ms=400)
    assert decide(pending(oldest_age_s=0.5), short_delay, DEFAULTS).cut is Cut.WORDS


def test_hints_refuse_negative_values() -> None:
    with pytest.raises(ValueError, match="min_words"):
        StreamingHints(min_words=-1)
    with pytest.raises(ValueError, match="char_schedule"):
        StreamingHints(char_schedule=(0,))


class Clock:
    """Time the test advances (the protocol reads it through its `clock` argument)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def paced(clock: Clock, **hints: int) -> AgentProtocol:
    p = AgentProtocol(ProtocolLimits(), voice_exists=lambda voice: True, streaming=DEFAULTS, clock=clock)
    p.handle(StartContext("c", streaming=StreamingHints(**hints)))
    return p


def spoken(actions: list[object]) -> list[str]:
    return [a.text for a in actions if isinstance(a, Speak)]


def wakes(actions: list[object]) -> list[float]:
    return [a.after_s for a in actions if isinstance(a, Wake)]


def test_tokens_of_a_turn_start_speaking_at_the_first_clause_and_each_sentence_end() -> None:
    clock = Clock()
    p = paced(clock)
    said: list[str] = []
    for token in ["Well,", " I", " think", " that", " the", " weather,", " all", " things", " considered,",
                  " is", " fine", " today.", " Shall", " we", " go"]:
        said += spoken(p.handle(AppendText("c", token)))
    # The first clause with five words before it is spoken while nothing else is; the next clause waits
    # (the first is still being synthesised) until its sentence ends.
    assert said == ["Well, I think that the weather,", "all things considered, is fine today."]
    assert spoken(p.speech_done("c")) == []  # idle again, but only "Shall we go" is pending: no clause
    assert spoken(p.handle(EndContext("c"))) == ["Shall we go"]


def test_a_sentence_sent_without_trailing_space_is_spoken_when_the_next_begins_or_after_a_pause() -> None:
    clock = Clock()
    p = paced(clock, clause_min_words=0)
    assert spoken(p.handle(AppendText("c", "It is sunny today."))) == []
    # The next message starts a new sentence without a space: the first is spoken, nothing glued.
    assert spoken(p.handle(AppendText("c", "Shall we walk?"))) == ["It is sunny today."]
    actions = p.handle(AppendText("c", ""))
    assert spoken(actions) == [] and wakes(actions) == [pytest.approx(0.15)]
    clock.now += 0.2
    assert spoken(p.wake("c")) == ["Shall we walk?"]


def test_numbers_and_lower_case_continuations_are_not_cut() -> None:
    clock = Clock()
    p = paced(clock, clause_min_words=0)
    assert spoken(p.handle(AppendText("c", "Pi is 3."))) == []
    assert spoken(p.handle(AppendText("c", "14 and e.g."))) == []
    assert spoken(p.handle(AppendText("c", "this stays"))) == []
    assert spoken(p.handle(EndContext("c"))) == ["Pi is 3.14 and e.g.this stays"]


def test_buffer_delay_speaks_whole_words_and_zero_speaks_every_piece() -> None:
    clock = Clock()
    p = paced(clock, max_buffer_delay_ms=500, clause_min_words=0)
    actions = p.handle(AppendText("c", "no punctuation at al"))
    assert spoken(actions) == [] and wakes(actions) == [pytest.approx(0.5)]
    clock.now += 0.5
    assert spoken(p.wake("c")) == ["no punctuation at"]
    immediate = paced(Clock(), max_buffer_delay_ms=0)
    assert spoken(immediate.handle(AppendText("c", "Hello there,"))) == ["Hello there,"]
    assert spoken(immediate.handle(AppendText("c", " it is sunny"))) == ["it is sunny"]


def test_word_budget_speaks_that_many_words_at_a_time() -> None:
    p = paced(Clock(), min_words=3, clause_min_words=0)
    assert spoken(p.handle(AppendText("c", "one two"))) == []
    assert spoken(p.handle(AppendText("c", " three four five six"))) == ["one two three four five"]


def test_native_start_takes_the_streaming_knobs_and_refuses_bad_ones() -> None:
    p = AgentProtocol(ProtocolLimits(), voice_exists=lambda voice: True)
    frame = json.dumps(
        {"type": "start", "context_id": "c", "max_buffer_delay_ms": 0, "min_words": 4, "clause_min_words": 0}
    )
    (start,) = NativeDialect().decode(frame, p)
    assert isinstance(start, StartContext)
    assert start.streaming == StreamingHints(max_buffer_delay_ms=0, min_words=4, clause_min_words=0)
    with pytest.raises(ProtocolError) as refused:
        NativeDialect().decode('{"type": "start", "context_id": "c", "min_words": -2}', p)
    assert refused.value.code == "invalid_message"
