"""Chunk schedules: the hop sequences and the token ranges the scheduler hands to token2wav."""

import math

import pytest

from realtime.schedule import (
    AdaptiveHops,
    Chunk,
    ChunkScheduler,
    EqualHops,
    ExponentialHops,
    FirstChunkByLoad,
    Playback,
    Progress,
    ScheduleKind,
    chunk_due,
    graphed_hops,
    make_policy,
)


def drain(scheduler: ChunkScheduler, total: int, step: int = 1) -> list[Chunk]:
    """Feed `total` tokens `step` at a time, then end the stream; every chunk taken on the way."""
    chunks = []
    available = 0
    while available < total:
        available = min(total, available + step)
        while (chunk := scheduler.next_chunk(available, ended=False)) is not None:
            chunks.append(chunk)
    while (chunk := scheduler.next_chunk(available, ended=True)) is not None:
        chunks.append(chunk)
    return chunks


def test_exponential_hops_are_15_then_25_doubling():
    policy = ExponentialHops()
    assert [policy.hop(i, Progress()) for i in range(6)] == [15, 25, 50, 100, 200, 400]
    assert policy.hop(20, Progress()) == 400


def test_the_graphed_hops_follow_the_first_chunk_and_default_to_the_engines_own():
    """The service tells token2wav which chunk lengths to capture graphs for; by default they are the
    ones the engine captures on its own (its benchmarks' and tests' shapes)."""
    from engines.token2wav.torch_backend import GRAPH_HOPS

    assert graphed_hops() == GRAPH_HOPS == (15, 25, 50, 100)
    assert graphed_hops(10) == (10, 25, 50, 100)
    first = make_policy(ScheduleKind.EXPONENTIAL, 10)
    assert [first.hop(i, Progress()) for i in range(4)] == [10, 25, 50, 100]
    assert make_policy(ScheduleKind.EQUAL, 10).hop(0, Progress()) == EqualHops().size  # its own


def test_exponential_chunks_carry_three_lookahead_tokens_and_the_last_flushes():
    chunks = drain(ChunkScheduler(ExponentialHops()), total=100)
    assert [(c.start, c.end, c.last) for c in chunks] == [
        (0, 18, False),
        (15, 43, False),
        (40, 93, False),
        (90, 100, True),
    ]
    assert sum(c.consumed for c in chunks) == 100


def test_no_chunk_before_hop_plus_lookahead_tokens():
    scheduler = ChunkScheduler(ExponentialHops())
    assert scheduler.next_chunk(17, ended=False) is None
    assert scheduler.next_chunk(18, ended=False) == Chunk(0, 0, 18, last=False)


def test_tokens_wanted_is_what_the_next_chunk_waits_for():
    scheduler = ChunkScheduler(ExponentialHops())
    wanted = []
    for available in range(200):
        if scheduler.next_chunk(available, ended=False) is not None:
            assert available == wanted[-1]  # the chunk came exactly when its wanted tokens were there
        wanted.append(scheduler.tokens_wanted())
    assert sorted(set(wanted)) == [18, 43, 93, 193, 393]


def ended_at_once(scheduler: ChunkScheduler, total: int) -> list[Chunk]:
    chunks = []
    while (chunk := scheduler.next_chunk(total, ended=True)) is not None:
        chunks.append(chunk)
    return chunks


def test_exactly_hop_plus_lookahead_at_the_end_is_one_final_chunk():
    chunks = ended_at_once(ChunkScheduler(ExponentialHops()), total=18)
    assert [(c.start, c.end, c.last) for c in chunks] == [(0, 18, True)]


def test_short_stream_is_a_single_final_chunk_and_empty_stream_an_empty_one():
    assert [(c.start, c.end, c.last) for c in drain(ChunkScheduler(ExponentialHops()), 7)] == [(0, 7, True)]
    assert [(c.start, c.end, c.last) for c in drain(ChunkScheduler(ExponentialHops()), 0)] == [(0, 0, True)]


def test_many_pending_tokens_at_the_end_still_come_in_bounded_chunks():
    chunks = ended_at_once(ChunkScheduler(EqualHops(10)), total=45)
    assert [(c.start, c.end, c.last) for c in chunks] == [
        (0, 13, False),
        (10, 23, False),
        (20, 33, False),
        (30, 43, False),
        (40, 45, True),
    ]


def test_every_token_is_consumed_exactly_once_for_every_kind():
    for kind in ScheduleKind:
        for total in (1, 17, 18, 19, 60, 333):
            chunks = drain(ChunkScheduler(make_policy(kind)), total, step=7)
            assert sum(c.consumed for c in chunks) == total
            assert chunks[-1].last and all(not c.last for c in chunks[:-1])
            assert all(b.start == a.start + a.consumed for a, b in zip(chunks, chunks[1:], strict=False))


def test_adaptive_hops_grow_with_buffered_audio_and_speed():
    policy = AdaptiveHops(granule=15, limit=400, safety=0.5)
    assert policy.hop(0, Progress(audio_ahead_s=10, tokens_per_s=100)) == 15
    assert policy.hop(1, Progress()) == 15
    # 2 s buffered, half of it usable, 100 tokens/s: 100 tokens → 6 granules of 15.
    assert policy.hop(1, Progress(audio_ahead_s=2.0, tokens_per_s=100)) == 90
    assert policy.hop(1, Progress(audio_ahead_s=100.0, tokens_per_s=100)) == 400
    assert policy.hop(1, Progress(audio_ahead_s=0.1, tokens_per_s=10)) == 15


def test_scheduler_rejects_tokens_going_backwards_and_stops_after_the_last_chunk():
    scheduler = ChunkScheduler(EqualHops(5))
    assert scheduler.next_chunk(8, ended=False) is not None
    with pytest.raises(ValueError, match="backwards"):
        scheduler.next_chunk(2, ended=False)
    assert scheduler.next_chunk(9, ended=True) == Chunk(1, 5, 9, last=True)
    assert scheduler.finished and scheduler.next_chunk(9, ended=True) is None


def test_a_stream_gets_the_light_load_first_chunk_while_few_streams_are_open():
    rule = FirstChunkByLoad(tokens=15, light_tokens=10, light_streams=16)
    hops = [rule.first_hop(open_streams) for open_streams in (0, 1, 15, 16, 17, 300)]
    assert hops == [10, 10, 10, 15, 15, 15]
    assert rule.first_hops == (15, 10)
    off = FirstChunkByLoad(tokens=15, light_tokens=10, light_streams=0)
    assert off.first_hop(0) == 15 and off.first_hops == (15,)
    same = FirstChunkByLoad(tokens=12, light_tokens=12, light_streams=4)
    assert same.first_hop(0) == 12 and same.first_hops == (12,)
    assert FirstChunkByLoad() == FirstChunkByLoad(ExponentialHops.first, 10, 0)  # off by default


@pytest.mark.parametrize(
    "bad",
    [
        lambda: FirstChunkByLoad(tokens=0),
        lambda: FirstChunkByLoad(light_tokens=0),
        lambda: FirstChunkByLoad(light_streams=-1),
        lambda: ExponentialHops(first=0),
        lambda: EqualHops(0),
        lambda: AdaptiveHops(safety=0),
        lambda: AdaptiveHops(granule=50, limit=10),
    ],
)
def test_invalid_policies_are_refused(bad):
    with pytest.raises(ValueError):
        bad()


def test_chunk_due_puts_first_audio_first_then_the_listener_who_runs_out_soonest() -> None:
    first = chunk_due(None, 0.0)
    nearly_dry = chunk_due(100.0, 0.5)  # first audio at t=100 s, 0.5 s of audio sent
    well_fed = chunk_due(99.0, 4.0)
    assert first == -math.inf
    assert sorted([well_fed, first, nearly_dry]) == [first, nearly_dry, well_fed]
    assert nearly_dry == 100.5


def test_a_playback_is_due_at_once_until_its_first_audio_then_when_its_audio_runs_out():
    playback = Playback()
    assert playback.due() == -math.inf and not playback.started and playback.ahead_s(5.0) == 0.0
    playback.produced(10.0, 0.0)  # an empty chunk starts nothing
    assert not playback.started
    playback.produced(10.0, 0.72)
    playback.produced(10.3, 1.12)  # a second text's audio on the same listener adds to the same timeline
    assert playback.started and playback.due() == pytest.approx(10.0 + 1.84)
    assert playback.ahead_s(10.5) == pytest.approx(1.84 - 0.5)
