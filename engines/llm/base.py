"""The interface every speech-token LLM engine implements (PyTorch, TensorRT-LLM).

A caller submits an `LLMRequest` and iterates the returned `TokenStream`; each item is a list of
new speech tokens (0..6560). The stream ends when the model stops (eos, max length) and raises
`LLMError` if the engine failed the request. Closing or cancelling the stream frees the engine's
slot for that request at the next step boundary.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import enum
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Self, TypeVar

from engines.errors import CodedError


class LLMError(CodedError, RuntimeError):
    """A request the engine could not serve; `code` is machine readable."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding rules. Defaults are CosyVoice2's (RAS, top-p 0.8, top-k 25)."""

    temperature: float = 1.0
    top_k: int = 25
    top_p: float = 0.8
    repetition_penalty: float = 1.0
    use_ras: bool = True
    ras_window: int = 10
    ras_tau: float = 0.1
    seed: int | None = None
    min_token_ratio: float = 2.0  # min speech tokens per target text token
    max_token_ratio: float = 20.0
    # Benchmarks: ignore eos and emit exactly this many tokens (random weights never stop on their own).
    fixed_length: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.ras_window < 1 or self.ras_tau <= 0:
            raise ValueError(f"ras_window/ras_tau must be positive, got {self.ras_window}/{self.ras_tau}")
        if not 0 <= self.min_token_ratio <= self.max_token_ratio:
            raise ValueError(f"need 0 <= min_token_ratio <= max_token_ratio, got {self.min_token_ratio}, "
                             f"{self.max_token_ratio}")
        if self.fixed_length is not None and self.fixed_length < 1:
            raise ValueError(f"fixed_length must be >= 1, got {self.fixed_length}")

    def length_bounds(self, target_text_len: int) -> tuple[int, int]:
        """(min, max) speech tokens for a target text of `target_text_len` tokens."""
        if self.fixed_length is not None:
            return self.fixed_length, self.fixed_length
        return int(self.min_token_ratio * target_text_len), int(self.max_token_ratio * target_text_len)


class PromptMode(enum.StrEnum):
    """CosyVoice2's inference modes: what the LLM prompt holds besides the target text (§3.2).

    - `zero_shot`: the voice's transcript before the target text and its speech tokens after task_id;
    - `cross_lingual`: neither (text in another language than the voice's clip, none of the clip's
      words to leak in);
    - `instruct2`: an instruction ending in `<|endofprompt|>` before the target text, no speech tokens.

    token2wav reads the voice's speaker embedding, prompt tokens and prompt mel in every mode.
    `engines.llm.model.layout_prompt` builds each mode's prompt from a voice.
    """

    ZERO_SHOT = "zero_shot"
    CROSS_LINGUAL = "cross_lingual"
    INSTRUCT2 = "instruct2"


ALL_MODES = frozenset(PromptMode)


@dataclass(frozen=True)
class LLMPrompt:
    """The prompt side of requests: ids before the target text and speech tokens after task_id.

    One per voice and mode (per instruction in instruct2), shared by every request made with it.
    """

    mode: PromptMode
    text_ids: tuple[int, ...]
    speech_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        check_layout(self.mode, self.text_ids, self.speech_tokens)

    def request(self, request_id: str, text_ids: Sequence[int], sampling: SamplingParams) -> LLMRequest:
        return LLMRequest(request_id, text_ids, self.text_ids, self.speech_tokens, sampling, self.mode)


def check_layout(mode: PromptMode, prompt_text_ids: Sequence[int],
                 prompt_speech_tokens: Sequence[int]) -> None:
    """ValueError unless the prompt parts are what `mode` allows (see `PromptMode`)."""
    if mode is PromptMode.CROSS_LINGUAL and (prompt_text_ids or prompt_speech_tokens):
        raise ValueError("a cross_lingual prompt has neither prompt text nor prompt speech tokens")
    if mode is PromptMode.INSTRUCT2 and (not prompt_text_ids or prompt_speech_tokens):
        raise ValueError("an instruct2 prompt has an instruction as prompt text and no prompt speech tokens")


@dataclass(frozen=True)
class LLMRequest:
    """One synthesis segment: the prompt of its `mode` (see `PromptMode`) and the target text.

    `prompt_text_ids` precede the target text (the voice's transcript in zero_shot, the instruction in
    instruct2) and `prompt_speech_tokens` follow task_id (zero_shot only). Length bounds count the
    target text only, in every mode.
    """

    request_id: str
    text_ids: Sequence[int]  # target text token ids
    prompt_text_ids: Sequence[int] = ()
    prompt_speech_tokens: Sequence[int] = ()
    sampling: SamplingParams = field(default_factory=SamplingParams)
    mode: PromptMode = PromptMode.ZERO_SHOT

    def __post_init__(self) -> None:
        if not self.text_ids:
            raise ValueError("text_ids must not be empty")
        check_layout(self.mode, self.prompt_text_ids, self.prompt_speech_tokens)


@dataclass(frozen=True)
class LLMStats:
    """What a dashboard and the admission policy need to know about an engine."""

    max_slots: int
    active: int
    waiting: int
    kv_tokens_used: int = 0
    kv_tokens_total: int = 0
    kv_bytes_total: int = 0  # device memory of the KV cache (0 where the engine does not know it)
    steps: int = 0  # engine steps since the start (0 where the engine does not count them)
    step_seconds: float = 0.0  # wall time spent in those steps
    prefill_calls: int = 0  # batched prefill calls since the start (0 where the engine does not count them)
    prefill_rows: int = 0  # prompt chunks those calls prefilled (a burst's prompts in few calls: many rows)
    first_tokens: int = 0  # requests whose first speech token reached the host (0: not counted)
    first_token_seconds: float = 0.0  # their summed times from `submit` to that token on the host


class TokenStream(AsyncIterator[list[int]], abc.ABC):
    """Speech tokens of one request, delivered as they are decoded."""

    request_id: str

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop generating; the engine frees the slot at its next step. Idempotent."""

    def want(self, tokens: int) -> None:
        """The consumer needs `tokens` tokens in all for now: the next iteration may wait until that
        many have come (or the stream ended), and the engine may pause this request once that many are
        on their way, until a later call asks for more. Until the first call every token is handed over
        as soon as it is decoded. Streams that cannot pace ignore it (this one)."""

    async def aclose(self) -> None:
        self.cancel()

    def __aiter__(self) -> TokenStream:
        return self


class QueuedTokenStream(TokenStream):
    """A `TokenStream` an engine thread feeds through the event loop.

    Every method runs on the event loop thread: the engine thread hands tokens over with
    `deliver_threadsafe`. `on_cancel(stream)` runs once when the consumer cancels before the stream
    finished; the engine then frees the request. Deliveries after the end (done, or cancelled) are
    dropped. `wanted` is what the consumer last asked for with `want` (the engine thread reads it);
    `on_want()` tells the engine it went up. A paced consumer is woken once its wanted tokens are in,
    not for every token: with many streams that spares the loop a task switch per stream and decode
    step.
    """

    def __init__(self, request_id: str, on_cancel: Callable[[Self], None],
                 on_want: Callable[[], None] | None = None) -> None:
        self.request_id = request_id
        self.wanted = sys.maxsize
        self._on_cancel = on_cancel
        self._on_want = on_want
        self._pending: list[int] = []
        self._received = 0  # tokens delivered so far
        self._finished = False
        self._error: LLMError | None = None
        self._ready = asyncio.Event()

    def deliver(self, tokens: list[int], done: bool, error: LLMError | None) -> None:
        """Queue `tokens`; `done` ends the stream, with `error` raised to the consumer if given."""
        if self._finished:
            return
        self._pending.extend(tokens)
        self._received += len(tokens)
        if done:
            self._finished = True
            self._error = error
        if done or self.wanted == sys.maxsize or self._received >= self.wanted:
            self._ready.set()

    def want(self, tokens: int) -> None:
        raised = tokens > self.wanted
        self.wanted = tokens
        if raised and self._on_want is not None:
            self._on_want()

    def cancel(self: Self) -> None:
        if self._finished:
            return
        self._finished = True
        self._pending.clear()
        self._ready.set()
        self._on_cancel(self)

    async def __anext__(self) -> list[int]:
        while not self._finished and (not self._pending or self._received < self.wanted < sys.maxsize):
            self._ready.clear()
            try:
                await self._ready.wait()
            except asyncio.CancelledError:
                self.cancel()
                raise
        if self._pending:
            tokens, self._pending = self._pending, []
            return tokens
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        raise StopAsyncIteration


Delivery = tuple[QueuedTokenStream, list[int], bool, LLMError | None]
"""`QueuedTokenStream.deliver`'s arguments, with the stream they are for."""


def deliver_threadsafe(loop: asyncio.AbstractEventLoop | None, deliveries: Sequence[Delivery]) -> None:
    """From an engine thread: `deliver` each of `deliveries` on `loop`, in one callback.

    One callback per engine step rather than per stream keeps the loop's wake-ups down under load. A
    loop that is not set or already closed gets nothing: no consumer is left to read the tokens.
    """
    if deliveries and loop is not None and not loop.is_closed():
        loop.call_soon_threadsafe(_deliver_all, deliveries)


def _deliver_all(deliveries: Sequence[Delivery]) -> None:
    for stream, tokens, done, error in deliveries:
        stream.deliver(tokens, done, error)


T = TypeVar("T")


async def build_in_thread(build: Callable[[], T], discard: Callable[[T], None]) -> T:
    """`build()` on a worker thread. A thread cannot be interrupted: if the caller is cancelled meanwhile
    (a sibling of an engine's start failed), the build is waited for and what it made is handed to
    `discard` (memory freed, processes shut down) before the cancellation goes on, so nothing the
    cancelled start made outlives it."""
    made = asyncio.ensure_future(asyncio.to_thread(build))
    try:
        return await asyncio.shield(made)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # the build failed too: the cancellation goes on all the same
            built = await made
            del made  # no reference left here (the traceback keeps this frame) once `discard` is done
            discard(built)
            del built
        raise


class LLMEngine(abc.ABC):
    """Accepts many requests; one loop owns the accelerator and batches them."""

    name: str
    modes: frozenset[PromptMode] = ALL_MODES  # the prompt modes it serves
    # Whether `start` sizes the engine's cache by the device memory free at that moment: then nothing
    # else on that device may take memory while it starts (TensorRT-LLM's KV cache is a fraction of it).
    sizes_cache_by_free_memory: bool = False

    def check_mode(self, request: LLMRequest) -> None:
        """LLMError `mode_not_supported` unless this engine serves `request.mode`."""
        if request.mode not in self.modes:
            served = ", ".join(sorted(self.modes))
            raise LLMError("mode_not_supported", f"the {self.name} LLM engine does not serve {request.mode} "
                                                 f"requests (it serves: {served})")

    @abc.abstractmethod
    async def start(self) -> None:
        """Load weights and warm up; the engine accepts requests afterwards."""

    @abc.abstractmethod
    async def stop(self) -> None:
        """Cancel every request and release the accelerator."""

    @abc.abstractmethod
    def submit(self, request: LLMRequest) -> TokenStream:
        """Queue a request; raises `LLMError` (code `context_too_long`, `busy`, `mode_not_supported`, ...)
        at once if invalid."""

    @abc.abstractmethod
    def stats(self) -> LLMStats: ...

    @property
    def waiting(self) -> int:
        """Requests queued, not decoding yet (`stats().waiting`; engines answer it without the rest)."""
        return self.stats().waiting

    @property
    @abc.abstractmethod
    def max_context(self) -> int:
        """Longest prompt + output sequence, in positions, a request may use."""
