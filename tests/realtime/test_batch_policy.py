"""The token2wav batch policy (pure): which waiting chunks go into the next call, and how long first
chunks hold for each other."""

from __future__ import annotations

import math

import pytest

from realtime.batch_policy import BatchPolicy, Decision, FirstChunkHold, RecentStepTime, WaitingChunk

FIRST = -math.inf
HOLD = FirstChunkHold(gap_s=0.004, max_s=0.012)


def chunk(due: float, order: int, arrived: float = 0.0, tokens: int = 28) -> WaitingChunk:
    return WaitingChunk(due, order, arrived, tokens)


def test_nothing_waiting_runs_nothing() -> None:
    assert BatchPolicy(8, HOLD).decide([], expected_first=3, now=1.0) == Decision()


def test_later_chunks_go_earliest_deadline_first_up_to_the_row_cap() -> None:
    waiting = [chunk(5.0, 0), chunk(2.0, 1), chunk(9.0, 2), chunk(2.0, 3)]
    assert BatchPolicy(3, HOLD).decide(waiting, expected_first=0, now=0.0).run == (1, 3, 0)


def test_a_first_chunk_never_shares_a_call_with_later_chunks() -> None:
    """Even with room in the call, the later chunks (however overdue) wait for the next one."""
    waiting = [chunk(-5.0, 0), chunk(FIRST, 1), chunk(0.5, 2), chunk(FIRST, 3)]
    decision = BatchPolicy(8, HOLD).decide(waiting, expected_first=0, now=0.0)
    assert decision == Decision(run=(1, 3))
    # Once they are gone, the later chunks run by deadline.
    rest = [waiting[0], waiting[2]]
    assert BatchPolicy(8, HOLD).decide(rest, expected_first=0, now=0.0).run == (0, 1)


def test_first_chunks_beyond_the_row_cap_go_in_arrival_order() -> None:
    waiting = [chunk(FIRST, order) for order in (4, 1, 3, 0, 2)]
    assert BatchPolicy(3, HOLD).decide(waiting, expected_first=5, now=0.0).run == (3, 1, 4)


def test_a_lone_first_chunk_runs_at_once_when_no_other_is_expected() -> None:
    decision = BatchPolicy(8, HOLD).decide([chunk(FIRST, 0, arrived=1.0)], expected_first=0, now=1.0)
    assert decision == Decision(run=(0,))


def test_first_chunks_hold_for_expected_ones_while_they_keep_coming() -> None:
    """Held until a gap after the latest arrival, never beyond max_s after the oldest."""
    policy = BatchPolicy(8, HOLD)
    one = [chunk(FIRST, 0, arrived=1.000)]
    assert policy.decide(one, expected_first=2, now=1.001) == Decision(hold_until=pytest.approx(1.004))
    two = [*one, chunk(FIRST, 1, arrived=1.003)]
    assert policy.decide(two, expected_first=1, now=1.003) == Decision(hold_until=pytest.approx(1.007))
    three = [*two, chunk(FIRST, 2, arrived=1.010)]  # kept coming: capped at 1.000 + 0.012
    assert policy.decide(three, expected_first=1, now=1.010) == Decision(hold_until=pytest.approx(1.012))
    assert policy.decide(three, expected_first=1, now=1.012).run == (0, 1, 2)


def test_the_hold_ends_when_the_gap_passes_without_an_arrival() -> None:
    waiting = [chunk(FIRST, 0, arrived=1.000), chunk(FIRST, 1, arrived=1.002)]
    assert BatchPolicy(8, HOLD).decide(waiting, expected_first=4, now=1.0061).run == (0, 1)


def test_a_full_call_of_first_chunks_runs_without_holding() -> None:
    waiting = [chunk(FIRST, order, arrived=1.0) for order in range(4)]
    assert BatchPolicy(4, HOLD).decide(waiting, expected_first=10, now=1.0).run == (0, 1, 2, 3)


def test_later_chunks_wait_out_a_hold_too() -> None:
    """While first chunks hold, nothing runs: a later call started now would delay them."""
    waiting = [chunk(0.1, 0, arrived=0.5), chunk(FIRST, 1, arrived=1.0)]
    decision = BatchPolicy(8, HOLD).decide(waiting, expected_first=1, now=1.0)
    assert decision.run == () and decision.hold_until == pytest.approx(1.004)


def test_the_gap_follows_a_slow_llm_step_up_to_the_maximum() -> None:
    """With LLM steps of 6 ms, first chunks a step apart still join (gap 1.5 steps = 9 ms)."""
    policy = BatchPolicy(8, HOLD)
    assert HOLD.gap(0.0) == HOLD.gap(0.001) == 0.004
    assert HOLD.gap(0.006) == pytest.approx(0.009)
    assert HOLD.gap(0.1) == HOLD.max_s
    one = [chunk(FIRST, 0, arrived=1.000)]
    assert policy.decide(one, 1, now=1.006, llm_step_s=0.006) == Decision(hold_until=pytest.approx(1.009))
    assert policy.decide(one, 1, now=1.006).run == (0,)  # step unknown: the 4 ms gap has passed


def test_recent_step_time_is_the_smoothed_mean_since_the_last_reading() -> None:
    recent = RecentStepTime(weight=0.5)
    assert recent.read(0, 0.0) == 0.0  # no step yet: unknown
    assert recent.read(10, 0.020) == pytest.approx(0.002)
    assert recent.read(10, 0.020) == pytest.approx(0.002)  # no new step: unchanged
    assert recent.read(15, 0.050) == pytest.approx(0.004)  # 5 steps of 6 ms, half weight
    with pytest.raises(ValueError, match="weight"):
        RecentStepTime(weight=0.0)


def test_a_zero_maximum_turns_holding_off() -> None:
    policy = BatchPolicy(8, FirstChunkHold(gap_s=0.004, max_s=0.0))
    decision = policy.decide([chunk(FIRST, 0, arrived=1.0)], expected_first=5, now=1.0, llm_step_s=0.01)
    assert decision.run == (0,)


@pytest.mark.parametrize(("gap_s", "max_s", "steps"), [(-0.001, 0.01, 1.0), (0.001, -0.01, 1.0),
                                                       (0.001, 0.01, -1.0)])
def test_a_hold_is_not_negative(gap_s: float, max_s: float, steps: float) -> None:
    with pytest.raises(ValueError, match="gap_s|steps"):
        FirstChunkHold(gap_s, max_s, steps)


def test_a_call_needs_a_row() -> None:
    with pytest.raises(ValueError, match="max_rows"):
        BatchPolicy(0)


def test_a_call_takes_chunks_by_deadline_up_to_the_token_cap() -> None:
    """Long chunks fill a call sooner: the cap bounds the call's work, hence how long a chunk that
    becomes urgent meanwhile waits for it."""
    policy = BatchPolicy(64, HOLD, max_tokens=250)
    long_ones = [chunk(5.0 + i, i, tokens=103) for i in range(6)]
    assert policy.decide(long_ones, expected_first=0, now=0.0).run == (0, 1)  # 206; a third makes 309
    mixed = [chunk(9.0, 0, tokens=103), chunk(1.0, 1, tokens=28), chunk(2.0, 2, tokens=53),
             chunk(3.0, 3, tokens=203)]
    # By deadline: 28 + 53 fit, the 203-token chunk would pass the cap, and nothing after it is taken.
    assert policy.decide(mixed, expected_first=0, now=0.0).run == (1, 2)
    assert BatchPolicy(64, HOLD).decide(mixed, expected_first=0, now=0.0).run == (1, 2, 3, 0)


def test_a_chunk_beyond_the_token_cap_runs_alone() -> None:
    huge = [chunk(1.0, 0, tokens=403), chunk(2.0, 1, tokens=28)]
    assert BatchPolicy(64, HOLD, max_tokens=250).decide(huge, expected_first=0, now=0.0).run == (0,)


def test_first_chunks_keep_to_the_token_cap_too() -> None:
    firsts = [chunk(FIRST, order, tokens=18) for order in range(10)]
    assert BatchPolicy(64, HOLD, max_tokens=100).decide(firsts, expected_first=0, now=0.0).run == (
        0, 1, 2, 3, 4)


def test_a_token_cap_is_positive() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        BatchPolicy(8, HOLD, max_tokens=0)


def test_a_later_chunk_due_within_two_calls_goes_before_first_chunks() -> None:
    """With calls of 0.2 s, a later chunk due within 0.4 s would run dry waiting out a call of first
    chunks and then its own: it goes first, with the other later chunks that urgent, by deadline; the
    first chunks wait one call."""
    waiting = [chunk(FIRST, 0), chunk(1.30, 1), chunk(FIRST, 2), chunk(1.05, 3), chunk(2.0, 4)]
    policy = BatchPolicy(8, HOLD)
    assert policy.decide(waiting, expected_first=0, now=1.0, call_s=0.2).run == (3, 1)
    # Not urgent yet, or no call time known yet: first audio first.
    assert policy.decide(waiting, expected_first=0, now=0.5, call_s=0.2).run == (0, 2)
    assert policy.decide(waiting, expected_first=0, now=1.0).run == (0, 2)
    patient = BatchPolicy(8, HOLD, urgent_calls=0)
    assert patient.decide(waiting, expected_first=0, now=1.0, call_s=0.2).run == (0, 2)


def test_an_urgent_later_chunk_does_not_wait_out_a_first_chunk_hold() -> None:
    waiting = [chunk(FIRST, 0, arrived=0.998), chunk(1.1, 1)]
    policy = BatchPolicy(8, HOLD)
    assert policy.decide(waiting, expected_first=3, now=1.0).hold_until is not None
    assert policy.decide(waiting, expected_first=3, now=1.0, call_s=0.1).run == (1,)


def test_urgent_calls_are_not_negative() -> None:
    with pytest.raises(ValueError, match="urgent_calls"):
        BatchPolicy(8, HOLD, urgent_calls=-1.0)


def test_recorded_steps_are_smoothed_like_read_ones() -> None:
    timed = RecentStepTime()
    timed.record(0.2)
    timed.record(0.4)
    assert timed.seconds == pytest.approx(0.3)
