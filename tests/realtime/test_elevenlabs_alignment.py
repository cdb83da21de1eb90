"""ElevenLabs' per-chunk character alignment (CharAligner) over arbitrary word timings and chunkings."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from realtime.protocol.elevenlabs import CharAligner
from realtime.session import WordTiming

words_strategy = st.lists(
    st.tuples(st.text("abcXYZ.,?!'", min_size=1, max_size=9), st.floats(0.0, 0.5), st.floats(0.0, 0.8)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(words_strategy, st.lists(st.floats(0.02, 0.6), min_size=1, max_size=10), st.integers(0, 3))
def test_alignments_cover_the_audio_never_negative_and_spell_the_words_exactly(spec, chunk_lengths, late):
    # Word timings as a session makes them: in order, each after the previous one's end.
    timings, clock = [], 0.0
    for text, pause, length in spec:
        start = clock + pause
        timings.append(WordTiming(text, start, start + length, True))
        clock = start + length
    edges = [0.0]
    for length in chunk_lengths:
        edges.append(edges[-1] + length)
    edges[-1] = max(edges[-1], clock)  # the last chunk ends the audio
    aligner = CharAligner()
    spelled, pending, covered_ms = "", list(timings), 0
    for index, (start, end) in enumerate(zip(edges, edges[1:], strict=False)):
        final = index == len(edges) - 2
        # A word arrives with the chunk it starts in, or `late` chunks later (a segment's last word).
        due = [w for w in pending if final or w.start_s < end - late * 0.05]
        pending = [w for w in pending if w not in due]
        alignment = aligner.chunk(tuple(due), start, end - start, final)
        if alignment is None:  # nothing starts here: the next alignment covers this chunk too
            assert not final or not due
            continue
        chars, starts = alignment["chars"], alignment["charStartTimesMs"]
        durations = alignment["charDurationsMs"]
        assert len(chars) == len(starts) == len(durations) >= 1
        assert starts == sorted(starts) and starts[0] >= 0 and min(durations) >= 0
        # The alignments, one after another, reach exactly to this chunk's end (in whole ms).
        covered_ms += starts[-1] + durations[-1]
        assert covered_ms == round(end * 1000)
        spelled += "".join(chars)
    # Exactly the words, one space between them: none glued, no space doubled, none leading.
    assert spelled == " ".join(w.word for w in timings)


def test_chunks_where_nothing_starts_add_no_characters():
    # A word, then two chunks with nothing new, then the next word: "the  park" was spelled before.
    aligner = CharAligner()
    first = aligner.chunk((WordTiming("the", 0.0, 0.2, False),), 0.0, 0.24, False)
    assert first == {"chars": list("the"), "charStartTimesMs": [0, 67, 133], "charDurationsMs": [67, 66, 107]}
    assert aligner.chunk((), 0.24, 0.2, False) is None
    assert aligner.chunk((), 0.44, 0.2, False) is None
    last = aligner.chunk((WordTiming("park", 0.7, 1.0, False),), 0.64, 0.4, True)
    assert last is not None and "".join(first["chars"] + last["chars"]) == "the park"
    # The space spans the pause from "the"'s end; times count from the end of the first alignment.
    assert last["charStartTimesMs"] == [0, 460, 535, 610, 685]
    assert sum(last["charDurationsMs"]) == 1040 - 240
