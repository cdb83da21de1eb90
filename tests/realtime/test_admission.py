"""Admission policy: refuse beyond the stream limit or when the engines are backed up."""

import pytest

from realtime.admission import AdmissionPolicy, Admit, Load, Refuse


def test_admits_below_the_limit_and_refuses_at_it():
    policy = AdmissionPolicy.for_streams(2, retry_after_s=3)
    assert policy.decide(Load(active_streams=1)) == Admit()
    refused = policy.decide(Load(active_streams=2))
    assert isinstance(refused, Refuse) and refused.retry_after_s == 3 and "2 concurrent" in refused.reason


def test_refuses_when_engine_queues_are_too_deep():
    policy = AdmissionPolicy(max_streams=10, max_llm_waiting=1, max_token2wav_queue=4)
    assert isinstance(policy.decide(Load(0, llm_waiting=2)), Refuse)
    assert isinstance(policy.decide(Load(0, token2wav_queue=5)), Refuse)
    assert policy.decide(Load(0, llm_waiting=1, token2wav_queue=4)) == Admit()


def test_invalid_limits_are_refused():
    with pytest.raises(ValueError):
        AdmissionPolicy(max_streams=0, max_llm_waiting=0, max_token2wav_queue=1)
