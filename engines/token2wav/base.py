"""The interface every token2wav backend implements (DiT or UNet flow, PyTorch or TensorRT).

Streaming contract (MODEL_FACTS §8): the caller keeps a token offset and hands each chunk the tokens
`[offset, offset + hop + 3)` (hop new tokens plus 3 lookahead tokens, which are handed again as the
first 3 tokens of the next chunk), or on the last chunk every remaining token `[offset, end)`.
Each call returns the audio that is final: chunk boundaries are cross-faded inside the stream, so the
concatenation of all returned pieces is the utterance.

These calls run on an engine thread and may be batched across streams with `run_chunks`, or with
`launch_chunks`, which returns once the device work is queued and waits for the audio in `wait()`, so
that a caller can tell the host's part of a call from the device's. Streams own all per-request
tensors; `close()` drops them at once.
"""

from __future__ import annotations

import abc
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engines.config import PRE_LOOKAHEAD, SAMPLE_RATE
from engines.voice import VoicePrompt


class SpeakerState(abc.ABC):
    """Per-voice tensors computed once (e.g. the DiT's prompt caches) and shared by its streams."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int: ...


class Token2WavStream(abc.ABC):
    """Per-request streaming state (flow and vocoder caches)."""

    @property
    @abc.abstractmethod
    def nbytes(self) -> int:
        """Device memory held by this stream's caches."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the caches now; the stream cannot be used afterwards. Idempotent."""


# A staged warm-up's steps (`Token2Wav.staged_warmup`); `close()` ends one mid-way.
WarmupSteps = Generator[None, None, None]


@dataclass
class ChunkJob:
    """One chunk of one stream. `tokens`: int64 (N,), lookahead included unless `last`."""

    stream: Token2WavStream
    tokens: torch.Tensor
    last: bool

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1:
            raise ValueError(f"chunk tokens must be 1-D, got shape {tuple(self.tokens.shape)}")
        if not self.last and self.tokens.numel() <= PRE_LOOKAHEAD:
            raise ValueError(f"a non-final chunk needs more than {PRE_LOOKAHEAD} tokens (lookahead), "
                             f"got {self.tokens.numel()}")


class LaunchedChunks(Protocol):
    """Chunks whose work `Token2Wav.launch_chunks` has queued."""

    def wait(self) -> list[torch.Tensor]:
        """Their audio, float32 (samples,) on the CPU in the jobs' order (blocks until it is there)."""
        ...


@dataclass(frozen=True)
class FinishedChunks:
    """Chunks already synthesised: `wait` returns their audio at once."""

    audio: list[torch.Tensor]

    def wait(self) -> list[torch.Tensor]:
        return self.audio


class Token2Wav(abc.ABC):
    """Speech tokens → 24 kHz mono float waveform in [-1, 1]."""

    name: str
    sample_rate: int = SAMPLE_RATE

    @abc.abstractmethod
    def prepare_speaker(self, voice: VoicePrompt) -> SpeakerState:
        """Everything about a voice the backend needs, computed once and reused by many streams."""

    @abc.abstractmethod
    def open_stream(self, speaker: SpeakerState) -> Token2WavStream:
        """A new utterance in that voice."""

    @abc.abstractmethod
    def run_chunk(self, job: ChunkJob) -> torch.Tensor:
        """Synthesise one chunk; returns float32 (samples,) on the CPU."""

    def run_chunks(self, jobs: Sequence[ChunkJob]) -> list[torch.Tensor]:
        """Synthesise chunks of several streams; backends override this to batch them."""
        return [self.run_chunk(job) for job in jobs]

    def launch_chunks(self, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        """`run_chunks` that may return before the device has finished: the streams' states are
        updated (the next chunk of a stream may be launched at once) and the audio comes from `wait()`.
        Backends that queue device work override it; here the chunks run to the end first."""
        return FinishedChunks(self.run_chunks(jobs))

    def prepare_warmup(self, speaker: SpeakerState, batches: Sequence[int]) -> None:  # noqa: B027
        """Start, and return at once, what `warmup(speaker, batches)` needs that other processes can do
        meanwhile (a cold start's compiling); `warmup` then waits for it. They may take device memory
        until then. Backends without such work do nothing."""

    def release_warmup(self) -> None:  # noqa: B027
        """No warm-up is coming (no default voice, say): release what the backend holds for one (a cold
        start's compile processes and the models they built on the device); it serves on. Backends
        holding nothing do nothing."""

    def close(self) -> None:
        """Release, when its owner stops, what the backend holds beside its streams: at least what
        `release_warmup` releases (a cold start's compile processes that no warm-up took, say)."""
        self.release_warmup()

    def warmup(self, speaker: SpeakerState, batches: Sequence[int]) -> None:  # noqa: B027
        """Before traffic: run the common chunk shapes at these batch sizes (captures graphs, loads
        kernels) so the first requests do not pay for it. Backends without such costs do nothing."""

    def staged_warmup(self, speaker: SpeakerState, batches: Sequence[int]) -> WarmupSteps:
        """`warmup` for a caller that serves meanwhile: the work until the first `yield` is what new
        streams need at once (traffic may come after it); each later step is a bounded piece of the rest
        (one chunk call or one graph capture: up to a few hundred milliseconds), which the caller runs
        when it has nothing else to do; the warm-up is complete once the steps are exhausted. Backends
        without such a split do all of `warmup` before the first `yield`."""
        self.warmup(speaker, batches)
        yield

    def stream_bytes_bound(self, speaker: SpeakerState, max_tokens: int) -> int | None:
        """The most device bytes a stream of `speaker` holds between its chunks over at most `max_tokens`
        tokens (what memory-aware admission reserves); None where the backend does not know it."""
        return None

    @abc.abstractmethod
    def offline(self, speaker: SpeakerState, tokens: torch.Tensor) -> torch.Tensor:
        """Whole utterance at once (no streaming); float32 (samples,) on the CPU."""

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...
