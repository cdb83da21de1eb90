"""When text that arrives piece by piece (an LLM's tokens) is spoken: the input-streaming policy.

Pure policy, no I/O and no clock of its own: the protocol core (`realtime/protocol/core.py`) describes
a context's pending text as a `PendingText` and asks `decide` what to cut now and when to ask again;
the streaming splitter (`engines.text.StreamingSentenceSplitter`) finds the boundaries. Whole sentences
are always spoken as soon as they are complete; this decides about the text after the last one.

In order, the pending text is spoken:
1. all of it, when the client asked for no buffering (`max_buffer_delay_ms` 0: each piece is spoken
   as it arrives, for clients that send whole sentences or phrases themselves);
2. its whole words, once it holds the client's character threshold (`char_schedule`, ElevenLabs'
   `chunk_length_schedule`: the k-th segment waits for `schedule[k]` characters) or word budget
   (`min_words`);
3. up to its last clause boundary, while nothing of the context is being synthesised and at least
   `clause_min_words` words come before it (the first words of a turn start speaking without
   waiting for the sentence to end; later clauses wait for their sentence while audio plays);
4. all of it, once it ends in terminal punctuation and nothing followed for `sentence_end_wait_ms`
   (the last sentence of an LLM turn, sent without a trailing space);
5. its whole words, once its oldest character waited `max_buffer_delay_ms`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Cut(enum.Enum):
    """What to take from the pending text now."""

    NOTHING = "nothing"
    ALL = "all"  # everything pending
    WORDS = "words"  # the whole words (the last, possibly unfinished, word stays)
    CLAUSE = "clause"  # up to the last clause boundary


@dataclass(frozen=True)
class StreamingHints:
    """What one client asked for, per context (None: the server's default)."""

    max_buffer_delay_ms: int | None = None
    min_words: int | None = None
    clause_min_words: int | None = None  # 0 turns clause cuts off
    char_schedule: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_buffer_delay_ms", "min_words", "clause_min_words"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must not be negative, got {value}")
        if any(chars <= 0 for chars in self.char_schedule):
            raise ValueError(f"char_schedule entries must be positive, got {self.char_schedule}")


@dataclass(frozen=True)
class InputStreamingDefaults:
    """The server's defaults for clients that give no hints."""

    max_buffer_delay_ms: int = 3000  # Cartesia's documented default
    sentence_end_wait_ms: int = 150  # a few LLM tokens' time: "3." may still become "3.14"
    clause_min_words: int = 5


@dataclass(frozen=True)
class PendingText:
    """A context's text received and not yet spoken, as the policy sees it."""

    chars: int  # non-whitespace characters pending
    whole_words: int
    clause_words: int  # words before the last clause boundary (0: none)
    ends_with_sentence_end: bool
    oldest_age_s: float  # since the oldest pending character arrived
    newest_age_s: float  # since the last piece arrived
    idle: bool  # nothing of the context is being synthesised
    segments_spoken: int  # segments of this context handed to synthesis so far


@dataclass(frozen=True)
class Decision:
    cut: Cut
    recheck_after_s: float | None = None  # ask again after this long if nothing else happens


def decide(pending: PendingText, hints: StreamingHints, defaults: InputStreamingDefaults) -> Decision:
    """What to speak of `pending` now, and when to look again (see the module docstring)."""
    if pending.chars == 0:
        return Decision(Cut.NOTHING)
    delay_ms = hints.max_buffer_delay_ms
    if delay_ms is None:
        delay_ms = defaults.max_buffer_delay_ms
    if delay_ms == 0:
        return Decision(Cut.ALL)
    if pending.whole_words:
        if hints.char_schedule:
            threshold = hints.char_schedule[min(pending.segments_spoken, len(hints.char_schedule) - 1)]
            if pending.chars >= threshold:
                return Decision(Cut.WORDS)
        if hints.min_words and pending.whole_words >= hints.min_words:
            return Decision(Cut.WORDS)
    clause_words = defaults.clause_min_words if hints.clause_min_words is None else hints.clause_min_words
    if pending.idle and clause_words and pending.clause_words >= clause_words:
        return Decision(Cut.CLAUSE)
    waits = [delay_ms / 1000 - pending.oldest_age_s]
    if pending.ends_with_sentence_end:
        waits.append(defaults.sentence_end_wait_ms / 1000 - pending.newest_age_s)
        if waits[-1] <= 0:
            return Decision(Cut.ALL)
    if waits[0] <= 0:
        return Decision(Cut.WORDS if pending.whole_words else Cut.ALL)
    return Decision(Cut.NOTHING, recheck_after_s=min(waits))
