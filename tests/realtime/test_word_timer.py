"""Word timings inside a segment: exact at its ends, proportional estimates within."""

from __future__ import annotations

import pytest

from realtime.session import ServiceError, SpeechRequest, WordTimer


def test_words_come_out_as_audio_covers_them_and_the_last_waits_for_the_end():
    timer = WordTimer(["one", "three", "seven"], expected_s=1.8)
    # Weights are len+1: 4, 6, 6 of 16 → starts at 0, 0.45, 1.125 s of 1.8 s.
    assert [w for w, *_ in timer.due(audio_end_s=0.3, known_s=0.6)] == ["one"]
    assert timer.due(audio_end_s=1.4, known_s=1.4) == [("three", 0.45, 1.125, True)]
    assert timer.due(audio_end_s=5.0, known_s=5.0) == []  # the last word waits for the real length
    (last,) = timer.finish(2.0)
    assert last == ("seven", 1.25, 2.0, True)  # starts at its estimate with the real length, ends exactly


def test_estimates_grow_with_what_is_known_and_never_overlap():
    timer = WordTimer(["a", "b", "c", "d"], expected_s=0.4)
    first = timer.due(audio_end_s=0.5, known_s=0.5)
    rest = timer.finish(4.0)
    words = first + rest
    assert [w for w, *_ in words] == ["a", "b", "c", "d"]
    for (_, start, end, _), (_, next_start, _, _) in zip(words, words[1:], strict=False):
        assert start <= end <= next_start
    assert words[-1][2] == 4.0


def test_a_single_word_segment_is_exact():
    assert WordTimer(["Hi."], expected_s=1.0).finish(0.8) == [("Hi.", 0.0, 0.8, False)]


def test_speed_is_checked():
    with pytest.raises(ServiceError) as info:
        SpeechRequest(text="x", speed=5.0)
    assert info.value.code == "invalid_speed"
