"""In-flight batching engine for the CosyVoice2 LM in PyTorch.

One engine thread owns every tensor. Each step it drains cancellations, admits waiting requests into
free cache slots, launches one batched prefill call over the next chunks of the prompts in line (several
prompts share one padded call, at most `prefill_chunk` positions of each), launches one batched decode
step over the slots in use, and only then reads back the tokens of the previous step and hands them to
the asyncio loop with `call_soon_threadsafe`. The GPU therefore computes step N while the host handles
step N - 1; a sequence that stopped at step N - 1 had a row in step N, whose token is dropped.

Sampling runs on the device inside both calls and the sampled tokens feed the next decode step there,
so the host never waits for the device except once per step, for the previous step's tokens (copied
into pinned memory). The decode batch is always slots `0..n` with `n` a bucketed size (new requests take
the lowest free slot); idle slots inside the batch are computed and ignored. Attention reads a bucketed
prefix of the cache. Each call shape is static, captured as a CUDA graph on CUDA and run eagerly on the
CPU.

A consumer may pace its request (`TokenStream.want`): a decode step runs only while some request's
consumer wants more tokens than were launched for it. A streaming consumer asks for the tokens of its
next audio chunk only, so the GPU is not spent decoding seconds ahead of playback while first chunks
of other streams wait for token2wav.
"""
from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from engines.config import SPEECH_CODEBOOK, ModelPaths, configs_for_models_dir
from engines.cuda_graphs import empty_cache
from engines.llm.base import (
    Delivery,
    LLMEngine,
    LLMError,
    LLMRequest,
    LLMStats,
    QueuedTokenStream,
    TokenStream,
    build_in_thread,
    deliver_threadsafe,
)
from engines.llm.model import CosyVoice2LM, load_llm, prompt_length
from engines.llm.qwen2 import EAGER_KERNELS, LayerKernels
from engines.llm.sampling import MAX_TOP_K
from engines.llm.torch_runner import ModelRunner, PrefillChunk, Readback, TorchLLMConfig, bucket

__all__ = ["ModelLoader", "TorchLLMConfig", "TorchLLMEngine"]

logger = logging.getLogger(__name__)

ModelLoader = Callable[[torch.device, torch.dtype], CosyVoice2LM]


def _within(ids: Sequence[int], bound: int) -> bool:
    """All of `ids` in [0, bound)."""
    return not ids or (min(ids) >= 0 and max(ids) < bound)


@dataclass(eq=False)
class _Sequence:
    """Engine-side state of one request, from submit until its slot is freed (nano-vllm's Sequence)."""

    request: LLMRequest
    stream: QueuedTokenStream
    prompt_len: int
    min_len: int
    max_len: int
    seed: int
    slot: int = -1
    prompt: Tensor | None = None  # prompt embeddings while the prefill is incomplete
    prefilled: int = 0
    launched: int = 0  # tokens whose sampling was launched on the device
    submitted: float = field(default_factory=time.perf_counter)  # when `submit` took it
    generated: int = 0  # tokens read back and accepted
    finished: bool = False  # tokens still in flight for it are dropped

    @property
    def decoding(self) -> bool:
        """Its prompt is prefilled and more tokens may be launched."""
        return self.prefilled == self.prompt_len and self.launched < self.max_len

    @property
    def hungry(self) -> bool:
        """It decodes and its consumer wants more tokens than are on their way."""
        return self.decoding and self.launched < self.stream.wanted

    @property
    def kv_tokens(self) -> int:
        return self.prefilled + self.generated



@dataclass
class _EngineState:
    """What the engine thread owns: sequences by phase and the free slots."""

    slots: list[_Sequence | None]
    free: list[int]  # heap: the lowest free slot is taken first, which keeps decode batches small
    prefilling: collections.deque[_Sequence] = field(default_factory=collections.deque)
    outbox: list[Delivery] = field(default_factory=list)
    in_flight: _Launch | None = None  # the last step's calls, whose tokens are not read back yet

    def held(self) -> Iterator[_Sequence]:
        return (seq for seq in self.slots if seq is not None)


@dataclass(frozen=True)
class _Launch:
    """One engine step's device calls: which sequence owns which row of the tokens being read back."""

    first_tokens: list[tuple[_Sequence, int]]  # prefill row of the sequences whose prompt it completed
    next_tokens: list[tuple[_Sequence, int]]  # decode row (= slot) of every decoded sequence
    readback: Readback


class TorchLLMEngine(LLMEngine):
    """`LLMEngine` over `CosyVoice2LM` with in-flight batching on one engine thread.

    `load_model(device, dtype)` builds the model; `start()` calls it off the event loop, allocates the
    cache and captures the CUDA graphs.
    """

    name = "torch"

    def __init__(self, config: TorchLLMConfig, load_model: ModelLoader) -> None:
        self.config = config
        self.modes = config.modes
        self._load_model = load_model
        self._runner: ModelRunner | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards `_waiting` (submit and the engine thread)
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._cancelled: collections.deque[QueuedTokenStream] = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._stop_tokens: frozenset[int] = frozenset()
        self._state = _EngineState(slots=[None] * config.max_slots, free=list(range(config.max_slots)))
        self._steps = 0
        self._step_seconds = 0.0
        self._prefill_calls = 0
        self._prefill_rows = 0
        self._first_tokens = 0
        self._first_token_seconds = 0.0
        self._seeds = random.Random()  # unseeded requests' seeds, drawn on the loop without a system call

    @classmethod
    def from_models_dir(cls, models_dir: Path, device: str = "cuda", **options: Any) -> TorchLLMEngine:
        """The engine over `<models_dir>/CosyVoice2-0.5B/llm.pt`; `options` are `TorchLLMConfig` fields."""
        llm_config = configs_for_models_dir(models_dir).llm
        config = TorchLLMConfig(device=device, **options)
        return cls(config, partial(load_llm, ModelPaths(Path(models_dir)).llm, llm_config))

    @property
    def max_context(self) -> int:
        return self.config.max_context

    async def start(self) -> None:
        if self._thread is not None or self._stopping:
            raise RuntimeError("a TorchLLMEngine can be started only once")
        self._loop = asyncio.get_running_loop()
        # A runner built for a cancelled start needs no shutting down: dropped, its memory is the allocator's.
        self._runner = await build_in_thread(self._build_runner, lambda runner: None)
        self._stop_tokens = frozenset(self._runner.model.cfg.stop_tokens)
        self._thread = threading.Thread(target=self._run, name="llm-engine", daemon=True)
        self._thread.start()
        logger.info("torch LLM engine on %s (%s), %d slots, context %d, cuda graphs: %d", self.config.device,
                    self.config.torch_dtype, self.config.max_slots, self.config.max_context,
                    len(self._runner.decode_graphs) + len(self._runner.prefill_graphs))

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        self._runner = None
        if self.config.torch_device.type == "cuda":
            # Between captures (a token2wav warm-up may still be stepping): off the loop, it may wait.
            await asyncio.to_thread(empty_cache)

    def submit(self, request: LLMRequest) -> TokenStream:
        runner = self._runner
        if runner is None or self._stopping:
            raise LLMError("not_running", "the LLM engine is not running")
        seq = self._sequence(request, runner.model.cfg.qwen.vocab_size)
        with self._lock:
            if len(self._waiting) >= self.config.max_waiting:
                raise LLMError("busy", f"{self.config.max_waiting} LLM requests are waiting already")
            self._waiting.append(seq)
        self._wake.set()
        return seq.stream

    @property
    def waiting(self) -> int:
        return len(self._waiting)  # admission asks per request: not a walk over every slot

    def stats(self) -> LLMStats:
        held = list(self._state.held())  # a snapshot of the engine thread's slots, read when asked
        return LLMStats(
            max_slots=self.config.max_slots,
            active=len(held),
            waiting=len(self._waiting),
            kv_tokens_used=sum(seq.kv_tokens for seq in held),
            kv_tokens_total=self.config.max_slots * self.config.max_context,
            kv_bytes_total=0 if self._runner is None else self._runner.cache.kv.nbytes,
            steps=self._steps,
            step_seconds=self._step_seconds,
            prefill_calls=self._prefill_calls,
            prefill_rows=self._prefill_rows,
            first_tokens=self._first_tokens,
            first_token_seconds=self._first_token_seconds,
        )

    # -- event loop side -----------------------------------------------------------------------------

    def _sequence(self, request: LLMRequest, text_vocab: int) -> _Sequence:
        """Validate `request` and size it, or raise `LLMError`."""
        self.check_mode(request)
        params = request.sampling
        # min/max run in C: this is on the event loop for every request, over hundreds of prompt tokens.
        if not _within(request.prompt_text_ids, text_vocab) or not _within(request.text_ids, text_vocab):
            raise LLMError("invalid_request", f"text token ids must be in [0, {text_vocab})")
        if not _within(request.prompt_speech_tokens, SPEECH_CODEBOOK):
            raise LLMError("invalid_request", f"prompt speech tokens must be in [0, {SPEECH_CODEBOOK})")
        if params.use_ras and params.ras_window > self.config.ras_history:
            raise LLMError("invalid_request", f"ras_window {params.ras_window} is above this engine's limit "
                                              f"of {self.config.ras_history}")
        if params.top_k > MAX_TOP_K:
            raise LLMError("invalid_request", f"top_k {params.top_k} is above this engine's limit of "
                                              f"{MAX_TOP_K}")
        min_len, max_len = params.length_bounds(len(request.text_ids))
        if max_len < 1:
            raise LLMError("invalid_request", "the length bounds allow no speech token for this text")
        prompt_len = prompt_length(len(request.prompt_text_ids) + len(request.text_ids),
                                   len(request.prompt_speech_tokens))
        room = self.config.max_context - prompt_len
        if room < max(min_len, 1):
            raise LLMError("context_too_long", f"the prompt takes {prompt_len} positions and needs at least "
                                               f"{max(min_len, 1)} more, but the context holds "
                                               f"{self.config.max_context}")
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        stream = QueuedTokenStream(request.request_id, self._cancel, self._wake.set)
        return _Sequence(request, stream, prompt_len, min_len, min(max_len, room), seed)

    def _cancel(self, stream: QueuedTokenStream) -> None:
        self._cancelled.append(stream)
        self._wake.set()

    # -- engine thread ---------------------------------------------------------------------------------

    def _build_runner(self) -> ModelRunner:
        started = time.perf_counter()
        model = self._load_model(self.config.torch_device, self.config.torch_dtype)
        if self.config.torch_device.type == "cuda":
            model.backbone.ops = self._cuda_kernels(model)
        runner = ModelRunner(model, self.config)
        loaded = time.perf_counter()
        if self.config.cuda_graphs and self.config.torch_device.type == "cuda":
            runner.capture_graphs()
            runner.seal_compilation()  # the graphs met every shape class: compile nothing while serving
        logger.info("torch LLM weights and cache ready in %.1f s, CUDA graphs captured in %.1f s",
                    loaded - started, time.perf_counter() - loaded)
        return runner

    def _cuda_kernels(self, model: CosyVoice2LM) -> LayerKernels:
        """The layers' fused kernels the configuration asks for (on CUDA)."""
        config = self.config
        kernels = (LayerKernels.compiled(config.precompiled, config.torch_device) if config.fused_elementwise
                   else EAGER_KERNELS)
        if self.config.decode_attention_kernel:
            from engines.llm import decode_attention  # Triton: present with CUDA builds of torch

            qwen = model.cfg.qwen
            if decode_attention.supports(qwen.head_dim, self.config.torch_dtype):
                programmatic = config.programmatic_launch and self._programmatic_launch_supported()
                # PDL pays where a step is a chain of these kernels alone, the rows the projections serve
                # (H200: -8 % a step at 1 and 16 rows); at 64 and 128 rows, between cuBLAS kernels, the
                # attention kernel's steps were 1-2 % slower with it (docs/benchmarks.md, 27th session).
                chained_rows = 0
                if config.decode_linear_kernels:  # the dtypes the attention kernel takes suit these too
                    from engines.llm.decode_linear import MAX_ROWS, DecodeLinears

                    linears = DecodeLinears(qwen.hidden_size, qwen.intermediate_size, config.torch_device,
                                            programmatic)
                    kernels = replace(kernels, decode_linears=linears)
                    chained_rows = MAX_ROWS
                kernel = decode_attention.DecodeAttention(config.max_slots, qwen.num_kv_heads,
                                                          config.torch_device, programmatic, chained_rows)
                kernels = replace(kernels, decode_attention=kernel)
        return kernels

    def _programmatic_launch_supported(self) -> bool:
        from engines.llm import programmatic_launch

        if programmatic_launch.supported(self.config.torch_device):
            return True
        # On by default: a GPU before Hopper (or an older Triton) is expected, not a misconfiguration.
        logger.info("no programmatic dependent launch on this GPU or Triton: decode kernels launch plainly")
        return False

    def _run(self) -> None:
        device = self.config.torch_device
        if device.type != "cuda":
            self._serve()
            return
        # Steps are short and every stream downstream waits on them: on a high-priority CUDA stream their
        # kernels go ahead of token2wav's long batches.
        with torch.cuda.stream(torch.cuda.Stream(device, priority=-1)):
            self._serve()

    def _serve(self) -> None:
        state = self._state
        while not self._stopping:
            if not self._has_work():
                self._wake.wait()
            self._wake.clear()
            started = time.perf_counter()
            try:
                self._step()
            except Exception:
                logger.exception("LLM engine step failed")
                state.in_flight = None
                for seq in list(state.held()):
                    self._finish(seq, LLMError("engine_error", "the LLM engine failed"))
            self._flush()
            self._steps += 1
            self._step_seconds += time.perf_counter() - started
        self._shut_down()

    def _has_work(self) -> bool:
        """Whether a step would do anything: admit, cancel, prefill, decode for a consumer that wants
        tokens, or read back the last step."""
        state = self._state
        return bool((self._waiting and state.free) or self._cancelled or state.in_flight or state.prefilling
                    or any(seq.hungry for seq in state.held()))

    def _step(self) -> None:
        """Launch this step's calls, then read back the previous step's tokens while these run."""
        self._drain_cancellations()
        self._admit()
        launch = self._launch()
        previous, self._state.in_flight = self._state.in_flight, launch
        if previous is not None:
            self._complete(previous)

    def _drain_cancellations(self) -> None:
        while self._cancelled:
            stream = self._cancelled.popleft()
            with self._lock:
                waiting = next((seq for seq in self._waiting if seq.stream is stream), None)
                if waiting is not None:
                    self._waiting.remove(waiting)
            held = next((seq for seq in self._state.held() if seq.stream is stream), None)
            if held is not None:
                self._free(held)

    def _admit(self) -> None:
        state = self._state
        admitted: list[_Sequence] = []
        with self._lock:
            while state.free and self._waiting:
                seq = self._waiting.popleft()
                seq.slot = heapq.heappop(state.free)
                state.slots[seq.slot] = seq
                admitted.append(seq)
        if admitted:
            self._begin(admitted)

    def _begin(self, seqs: list[_Sequence]) -> None:
        """Set up the admitted `seqs` for prefill; if that fails for a batch, one at a time, so that only
        a faulty request fails."""
        assert self._runner is not None
        try:
            prompts = self._runner.begin(seqs)
        except Exception:
            if len(seqs) > 1:
                for seq in seqs:
                    self._begin([seq])
                return
            logger.exception("admitting LLM request %s failed", seqs[0].request.request_id)
            self._finish(seqs[0], LLMError("engine_error", "the LLM engine failed to read the prompt"))
            return
        for seq, prompt in zip(seqs, prompts, strict=True):
            seq.prompt = prompt
            self._state.prefilling.append(seq)

    def _launch(self) -> _Launch | None:
        runner = self._runner
        assert runner is not None
        first_tokens = self._launch_prefill()
        next_tokens = self._launch_decode()
        if not (first_tokens or next_tokens):
            return None
        prefill_rows = max((row + 1 for _, row in first_tokens), default=0)
        decode_rows = max((slot + 1 for _, slot in next_tokens), default=0)
        return _Launch(first_tokens, next_tokens, runner.read_back(prefill_rows, decode_rows))

    def _plan_prefill(self) -> list[tuple[_Sequence, int]]:
        """The prompts at the head of the line that one prefill call takes, with the end of each chunk."""
        plan: list[tuple[_Sequence, int]] = []
        longest = 0
        for seq in self._state.prefilling:
            end = min(seq.prompt_len, seq.prefilled + self.config.prefill_chunk)
            widest = max(longest, end - seq.prefilled)
            if plan and self.config.prefill_shape(len(plan) + 1, widest) is None:
                break
            plan.append((seq, end))
            longest = widest
        return plan[: self.config.prefill_prompts_taken(len(plan), longest)] if plan else plan

    def _launch_prefill(self) -> list[tuple[_Sequence, int]]:
        """Prefill the next chunks; the sequences whose prompt this completes, with their row."""
        runner = self._runner
        assert runner is not None
        plan = self._plan_prefill()
        if not plan:
            return []
        chunks = []
        for seq, end in plan:
            assert seq.prompt is not None
            last = end == seq.prompt_len
            chunks.append(PrefillChunk(seq.slot, seq.prompt[seq.prefilled:end], seq.prefilled, last))
        try:
            runner.prefill(chunks)
        except Exception:
            logger.exception("prefill of %d LLM requests failed", len(plan))
            for seq, _ in plan:
                self._finish(seq, LLMError("engine_error", "the LLM engine failed while reading the prompt"))
            return []
        self._prefill_calls += 1
        self._prefill_rows += len(plan)
        completed = []
        for row, (seq, end) in enumerate(plan):
            seq.prefilled = end
            if end == seq.prompt_len:
                self._state.prefilling.remove(seq)
                seq.prompt = None
                self._launched_token(seq)
                completed.append((seq, row))
        return completed

    def _launch_decode(self) -> list[tuple[_Sequence, int]]:
        runner = self._runner
        assert runner is not None
        decoding = [seq for seq in self._state.held() if seq.decoding]
        # Decode only for consumers that want tokens now; the others ride along in the batch.
        if not any(seq.hungry for seq in decoding):
            return []
        size = bucket(self.config.batch_sizes, max(seq.slot for seq in decoding) + 1)
        # A sequence's input goes to position prompt_len + launched - 1.
        kv_len = bucket(self.config.kv_lengths, max(seq.prompt_len + seq.launched for seq in decoding))
        try:
            runner.decode(size, kv_len)
        except Exception:
            logger.exception("LLM decode step failed")
            for seq in decoding:
                self._finish(seq, LLMError("engine_error", "the LLM engine failed while decoding"))
            return []
        for seq in decoding:
            self._launched_token(seq)
        return [(seq, seq.slot) for seq in decoding]

    def _launched_token(self, seq: _Sequence) -> None:
        seq.launched += 1
        if seq.launched == seq.max_len:  # its last token is on its way: the device stops advancing it
            assert self._runner is not None
            self._runner.release(seq.slot)

    def _complete(self, launch: _Launch) -> None:
        """Wait for `launch`'s tokens and hand them to their sequences, first tokens first."""
        first_tokens, next_tokens = launch.readback.lists()
        now = time.perf_counter()
        for seq, row in launch.first_tokens:
            if not seq.finished:  # not cancelled or failed while its token was in flight
                self._first_tokens += 1
                self._first_token_seconds += now - seq.submitted
            self._accept(seq, first_tokens[row])
        for seq, slot in launch.next_tokens:
            self._accept(seq, next_tokens[slot])

    def _accept(self, seq: _Sequence, token: int) -> None:
        """Apply the stop rules to a freshly sampled token and queue it for the consumer."""
        if seq.finished:  # stopped, cancelled or failed while this token was in flight
            return
        seq.generated += 1
        if token in self._stop_tokens:
            self._finish(seq, None)
            return
        done = seq.generated >= seq.max_len
        self._state.outbox.append((seq.stream, [token], done, None))
        if done:
            self._free(seq)

    def _finish(self, seq: _Sequence, error: LLMError | None) -> None:
        """End `seq`'s stream (with `error` if given) and free its slot."""
        self._state.outbox.append((seq.stream, [], True, error))
        self._free(seq)

    def _free(self, seq: _Sequence) -> None:
        seq.prompt = None
        seq.finished = True
        state = self._state
        if seq.slot >= 0 and state.slots[seq.slot] is seq:
            state.slots[seq.slot] = None
            if seq in state.prefilling:
                state.prefilling.remove(seq)
            assert self._runner is not None
            self._runner.release(seq.slot)
            heapq.heappush(state.free, seq.slot)

    def _flush(self) -> None:
        outbox, self._state.outbox = self._state.outbox, []
        deliver_threadsafe(self._loop, outbox)

    def _shut_down(self) -> None:
        stopped = LLMError("stopped", "the LLM engine stopped")
        with self._lock:
            waiting, self._waiting = list(self._waiting), collections.deque()
        for seq in (*waiting, *self._state.held()):
            self._finish(seq, stopped)
        self._state.in_flight = None
        assert self._runner is not None
        self._runner.synchronize()  # nothing may still run on the device once the engine is stopped
        self._flush()
