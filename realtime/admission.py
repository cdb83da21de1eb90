"""Admission policy (pure): whether one more utterance may start given the current load."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """The load the decision looks at.

    active_streams: utterances admitted and not yet finished.
    llm_waiting: requests queued inside the LLM engine behind its busy slots.
    token2wav_queue: chunks waiting for the token2wav worker.
    """

    active_streams: int
    llm_waiting: int = 0
    token2wav_queue: int = 0


@dataclass(frozen=True)
class Admit:
    pass


@dataclass(frozen=True)
class Refuse:
    """`reason` is a sentence for the client; `retry_after_s` a hint for when to try again."""

    reason: str
    retry_after_s: int


Decision = Admit | Refuse


@dataclass(frozen=True)
class AdmissionPolicy:
    """Refuse beyond `max_streams` utterances, or when the engines are already backed up.

    `max_llm_waiting` and `max_token2wav_queue` bound the work queued in front of the engines: past
    them a new stream would only wait, so it is better told to come back.
    """

    max_streams: int
    max_llm_waiting: int
    max_token2wav_queue: int
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_streams < 1 or self.max_llm_waiting < 0 or self.max_token2wav_queue < 1:
            raise ValueError(f"invalid admission limits: {self}")

    @staticmethod
    def for_streams(max_streams: int, retry_after_s: int = 1) -> AdmissionPolicy:
        """Limits derived from the stream count alone: every admitted stream may queue one of each."""
        return AdmissionPolicy(max_streams, max_streams, 2 * max_streams, retry_after_s)

    def decide(self, load: Load) -> Decision:
        if load.active_streams >= self.max_streams:
            return Refuse(
                f"the server is at its limit of {self.max_streams} concurrent streams", self.retry_after_s
            )
        if load.llm_waiting > self.max_llm_waiting:
            return Refuse("the speech model has too many requests waiting", self.retry_after_s)
        if load.token2wav_queue > self.max_token2wav_queue:
            return Refuse("the vocoder has too much work queued", self.retry_after_s)
        return Admit()
