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
def test_every_chunk_is_covered_never_negative_and_spells_the_words(spec, chunk_lengths, late):
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
    spelled, pending = "", list(timings)
    for index, (start, end) in enumerate(zip(edges, edges[1:], strict=False)):
        final = index == len(edges) - 2
        # A word arrives with the chunk it starts in, or `late` chunks later (a segment's last word).
        due = [w for w in pending if final or w.start_s < end - late * 0.05]
        pending = [w for w in pending if w not in due]
        alignment = aligner.chunk(tuple(due), start, end - start, final)
        chars, starts = alignment["chars"], alignment["charStartTimesMs"]
        durations, chunk_ms = alignment["charDurationsMs"], round((end - start) * 1000)
        assert len(chars) == len(starts) == len(durations) >= 1
        assert starts == sorted(starts) and starts[0] >= 0 and min(durations) >= 0
        assert starts[-1] + durations[-1] == chunk_ms
        spelled += "".join(chars)
    assert " ".join(spelled.split()) == " ".join(w.word for w in timings)
    # Words are never glued: every word but the first has a space before it.
    assert spelled.split() == [w.word for w in timings]
