"""`LLMEngine` over a TensorRT-LLM engine, through the executor API (`tensorrt_llm.bindings.executor`).

The engine is built from the Hugging Face export (`hf_export.py`) by `build_engines.py build-trtllm`.
The executor runs in-flight batching on its own threads; this module enqueues one streaming request per
`LLMRequest` and a single response thread waits on `Executor.await_responses`, maps the new ids to
speech tokens and hands them to the event loop with `call_soon_threadsafe`. Cancelling a stream calls
`Executor.cancel_request`; the executor frees the sequence at its next iteration.

Decoding follows the reference TensorRT-LLM runtime (MODEL_FACTS §3.5), with two differences that keep
it equal to the PyTorch engine in what the model computes:
- TensorRT-LLM's Qwen2 has no `lm_head` bias, so the export's bias (the speech head's bias, −inf
  elsewhere) is passed with every request as its `embedding_bias`, which the sampler adds to the logits;
- the minimum length (eos banned before it) and the stop rule (any of the three eos ids) are the
  reference's: `min_tokens` bans `end_id` = `<|eos1|>` only, `<|eos2|>`/`<|eos3|>` are stop words.
Sampling is TensorRT-LLM's top-k/top-p with temperature and repetition penalty; it has no RAS, so
`SamplingParams.use_ras` is not honoured here (as in the reference TensorRT-LLM runtime).

Importing this module does not import `tensorrt_llm`; constructing an engine without it raises
`TensorRTLLMUnavailable`.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from engines.config import ModelPaths
from engines.llm.base import (
    ALL_MODES,
    Delivery,
    LLMEngine,
    LLMError,
    LLMRequest,
    LLMStats,
    PromptMode,
    QueuedTokenStream,
    SamplingParams,
    TokenStream,
    build_in_thread,
    deliver_threadsafe,
)
from engines.llm.hf_export import SpeechVocab, read_lm_head_bias
from engines.llm.model import DTYPES

logger = logging.getLogger(__name__)

ENGINE_SUBDIR = "trtllm"


class TensorRTLLMUnavailable(RuntimeError):
    """`tensorrt_llm` cannot be imported on this machine."""


def import_executor_bindings() -> ModuleType:
    """`tensorrt_llm.bindings.executor`, or `TensorRTLLMUnavailable` saying how to get it."""
    try:
        from tensorrt_llm.bindings import executor  # type: ignore[import-not-found]
    except ImportError as exc:
        raise TensorRTLLMUnavailable(
            f"TensorRT-LLM is not importable ({exc}); the TensorRT-LLM LLM backend needs a CUDA host with "
            "the tensorrt_llm package (e.g. the nvcr.io/nvidia/tensorrt-llm/release image). "
            "Use the PyTorch LLM engine otherwise."
        ) from exc
    return executor


def engine_dir(models_dir: Path) -> Path:
    """Where `build_engines.py build-trtllm` writes the TensorRT-LLM engine of a models directory."""
    return ModelPaths(Path(models_dir)).engines / ENGINE_SUBDIR


@dataclass(frozen=True)
class EngineLimits:
    """What a built engine accepts, from its `config.json` (`build_config` and `pretrained_config`)."""

    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    vocab_size: int
    logits_dtype: torch.dtype

    @staticmethod
    def read(engine_path: Path) -> EngineLimits:
        path = Path(engine_path) / "config.json"
        try:
            config = json.loads(path.read_text())
            build, pretrained = config["build_config"], config["pretrained_config"]
            logits = pretrained.get("logits_dtype", "float32")
            return EngineLimits(
                max_batch_size=int(build["max_batch_size"]),
                max_input_len=int(build["max_input_len"]),
                max_seq_len=int(build["max_seq_len"]),
                vocab_size=int(pretrained["vocab_size"]),
                logits_dtype=DTYPES[logits],
            )
        except (OSError, KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path} is not a TensorRT-LLM engine config: {exc!r}") from exc


@dataclass(frozen=True)
class RequestPlan:
    """One `LLMRequest` in TensorRT-LLM terms: every executor `Request` argument, as plain data."""

    input_ids: list[int]
    max_tokens: int
    end_id: int
    stop_words: list[list[int]]
    bad_words: list[list[int]]
    sampling: dict[str, Any]  # `SamplingConfig` keyword arguments


def sampling_kwargs(params: SamplingParams, min_tokens: int, seed: int) -> dict[str, Any]:
    """`SamplingConfig` keyword arguments for one request (beam width 1)."""
    return {
        "top_k": params.top_k,
        "top_p": params.top_p,
        "temperature": params.temperature,
        "repetition_penalty": params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        "seed": seed,
        "min_tokens": min_tokens,
    }


def plan_request(request: LLMRequest, vocab: SpeechVocab, limits: EngineLimits, seed: int) -> RequestPlan:
    """Validate and translate `request`, or raise `LLMError` (`invalid_request`, `context_too_long`).

    The ids are the PyTorch engine's prompt embeddings' rows in the exported vocabulary, in every mode
    (the request holds its mode's prompt parts already: `engines.llm.model.layout_prompt`)."""
    try:
        input_ids = vocab.prompt_ids(request.prompt_text_ids, request.text_ids, request.prompt_speech_tokens)
    except ValueError as exc:
        raise LLMError("invalid_request", str(exc)) from exc
    params = request.sampling
    min_len, max_len = params.length_bounds(len(request.text_ids))
    if max_len < 1:
        raise LLMError("invalid_request", "the length bounds allow no speech token for this text")
    room = limits.max_seq_len - len(input_ids)
    if len(input_ids) > limits.max_input_len or room < max(min_len, 1):
        raise LLMError("context_too_long", f"the prompt takes {len(input_ids)} positions (engine: at most "
                                           f"{limits.max_input_len} in, {limits.max_seq_len} in all) and "
                                           f"needs at least {max(min_len, 1)} more")
    eos1, eos2, eos3 = vocab.eos_ids
    fixed = params.fixed_length is not None
    return RequestPlan(
        input_ids=input_ids,
        max_tokens=min(max_len, room),
        end_id=eos1,
        # A fixed-length request never stops on its own: every eos id is banned instead.
        stop_words=[] if fixed else [[eos2], [eos3]],
        bad_words=[[eos1], [eos2], [eos3]] if fixed else [],
        sampling=sampling_kwargs(params, min_len, seed),
    )


def speech_codes(ids: Sequence[int], vocab: SpeechVocab) -> tuple[list[int], bool]:
    """The speech codes at the front of `ids`, and whether a non-speech id (a stop) followed them."""
    codes: list[int] = []
    for hf_id in ids:
        code = vocab.to_speech(hf_id)
        if code is None:
            return codes, True
        codes.append(code)
    return codes, False


def runtime_bias(hf_bias: torch.Tensor, limits: EngineLimits) -> torch.Tensor:
    """The export's head bias as the engine's `embedding_bias`: the engine's logits dtype and width.

    −inf becomes the dtype's lowest finite value, so no sampling kernel ever computes inf − inf.
    """
    if hf_bias.shape != (limits.vocab_size,):
        raise ValueError(f"lm_head.bias has shape {tuple(hf_bias.shape)}; the engine has {limits.vocab_size} "
                         "logits")
    return hf_bias.float().clamp_min(torch.finfo(limits.logits_dtype).min).to(limits.logits_dtype)


@dataclass(frozen=True)
class TrtLlmConfig:
    """Where the engine and the export live and how the executor is set up."""

    engine_dir: Path
    hf_dir: Path
    max_waiting: int = 256
    kv_cache_free_gpu_memory_fraction: float = 0.5
    kv_cache_block_reuse: bool = False  # prompts differ from the first text token on: little to reuse
    response_poll_ms: int = 50  # the response thread notices `stop()` within this
    modes: frozenset[PromptMode] = ALL_MODES  # prompt modes served (see `TorchLLMConfig.modes`)

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("TrtLlmConfig.modes must name at least one prompt mode")
        if self.max_waiting < 1 or self.response_poll_ms < 1:
            raise ValueError(f"max_waiting/response_poll_ms must be positive, got {self.max_waiting}/"
                             f"{self.response_poll_ms}")
        if not 0 < self.kv_cache_free_gpu_memory_fraction <= 1:
            raise ValueError(f"kv_cache_free_gpu_memory_fraction must be in (0, 1], "
                             f"got {self.kv_cache_free_gpu_memory_fraction}")

    @staticmethod
    def for_models_dir(models_dir: Path, **options: Any) -> TrtLlmConfig:
        return TrtLlmConfig(engine_dir(models_dir), ModelPaths(Path(models_dir)).hf_llm, **options)


class _ExecutorStream(QueuedTokenStream):
    """A queued token stream that remembers its executor request."""

    def __init__(self, request_id: str, on_cancel: Callable[[_ExecutorStream], None]) -> None:
        super().__init__(request_id, on_cancel)
        self.executor_id: int | None = None
        self.started = False  # a first response arrived (it is decoding, not waiting)


class TrtLlmEngine(LLMEngine):
    """`LLMEngine` over a TensorRT-LLM executor with in-flight batching and streaming responses.

    `bindings` is the `tensorrt_llm.bindings.executor` module (imported when not given; tests pass a
    stand-in with the same classes).
    """

    name = "tensorrt_llm"
    sizes_cache_by_free_memory = True  # KvCacheConfig(free_gpu_memory_fraction=...)

    def __init__(self, config: TrtLlmConfig, bindings: ModuleType | None = None) -> None:
        self.config = config
        self.modes = config.modes
        self._tle = bindings if bindings is not None else import_executor_bindings()
        self._vocab = SpeechVocab.load(config.hf_dir)
        self._limits = EngineLimits.read(config.engine_dir)
        self._bias: torch.Tensor | None = None
        self._executor: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards `_streams` and their `started` (event loop, response thread)
        self._seeds = random.Random()  # unseeded requests' seeds, drawn on the loop without a system call
        self._streams: dict[int, _ExecutorStream] = {}
        self._stopping = False

    @classmethod
    def from_models_dir(cls, models_dir: Path, **options: Any) -> TrtLlmEngine:
        return cls(TrtLlmConfig.for_models_dir(models_dir, **options))

    @property
    def max_context(self) -> int:
        return self._limits.max_seq_len

    async def start(self) -> None:
        if self._thread is not None or self._stopping:
            raise RuntimeError("a TrtLlmEngine can be started only once")
        self._loop = asyncio.get_running_loop()
        hf_bias = await asyncio.to_thread(read_lm_head_bias, self.config.hf_dir)
        self._bias = runtime_bias(hf_bias, self._limits)
        self._executor = await build_in_thread(self._create_executor, lambda executor: executor.shutdown())
        self._thread = threading.Thread(target=self._pump_responses, name="trtllm-responses", daemon=True)
        self._thread.start()
        logger.info("TensorRT-LLM engine %s: batch %d, input %d, sequence %d positions; sampling is "
                    "top-k/top-p (no RAS)", self.config.engine_dir, self._limits.max_batch_size,
                    self._limits.max_input_len, self._limits.max_seq_len)

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        stopped = LLMError("stopped", "the LLM engine stopped")
        for stream in streams:
            stream.deliver([], True, stopped)
        await asyncio.to_thread(self._executor.shutdown)
        self._executor = None

    def submit(self, request: LLMRequest) -> TokenStream:
        if self._executor is None or self._stopping:
            raise LLMError("not_running", "the LLM engine is not running")
        self.check_mode(request)
        seed = request.sampling.seed if request.sampling.seed is not None else self._seeds.getrandbits(63)
        plan = plan_request(request, self._vocab, self._limits, seed)
        stream = _ExecutorStream(request.request_id, self._cancel)
        with self._lock:
            waiting = sum(1 for s in self._streams.values() if not s.started)
            if waiting >= self.config.max_waiting:
                raise LLMError("busy", f"{self.config.max_waiting} LLM requests are waiting already")
            try:
                stream.executor_id = self._executor.enqueue_request(self._executor_request(plan))
            except RuntimeError as exc:  # the executor refuses requests it cannot schedule
                raise LLMError("invalid_request", f"TensorRT-LLM refused the request: {exc}") from exc
            self._streams[stream.executor_id] = stream
        return stream

    def stats(self) -> LLMStats:
        with self._lock:
            active = sum(1 for s in self._streams.values() if s.started)
            total = len(self._streams)
        return LLMStats(max_slots=self._limits.max_batch_size, active=active, waiting=total - active)

    # -- executor objects ------------------------------------------------------------------------------

    def _create_executor(self) -> Any:
        tle = self._tle
        kv_cache = tle.KvCacheConfig(
            enable_block_reuse=self.config.kv_cache_block_reuse,
            free_gpu_memory_fraction=self.config.kv_cache_free_gpu_memory_fraction,
        )
        executor_config = tle.ExecutorConfig(max_beam_width=1, kv_cache_config=kv_cache)
        return tle.Executor(str(self.config.engine_dir), tle.ModelType.DECODER_ONLY, executor_config)

    def _executor_request(self, plan: RequestPlan) -> Any:
        tle = self._tle
        return tle.Request(
            input_token_ids=plan.input_ids,
            max_tokens=plan.max_tokens,
            streaming=True,
            sampling_config=tle.SamplingConfig(**plan.sampling),
            output_config=tle.OutputConfig(exclude_input_from_output=True),
            end_id=plan.end_id,
            pad_id=plan.end_id,
            stop_words=plan.stop_words or None,
            bad_words=plan.bad_words or None,
            embedding_bias=self._bias,
        )

    # -- event loop side -------------------------------------------------------------------------------

    def _cancel(self, stream: _ExecutorStream) -> None:
        with self._lock:
            if stream.executor_id is None or self._streams.pop(stream.executor_id, None) is None:
                return
        self._executor.cancel_request(stream.executor_id)

    # -- response thread -------------------------------------------------------------------------------

    def _pump_responses(self) -> None:
        timeout = datetime.timedelta(milliseconds=self.config.response_poll_ms)
        while not self._stopping:
            try:
                responses = self._executor.await_responses(timeout=timeout)
            except Exception:
                logger.exception("waiting for TensorRT-LLM responses failed")
                self._fail_all()
                return
            deliver_threadsafe(self._loop, self._collect(responses))

    def _collect(self, responses: Sequence[Any]) -> list[Delivery]:
        """Deliveries for `responses`; finished requests leave `_streams` here."""
        deliveries: list[Delivery] = []
        stopped: list[int] = []
        with self._lock:
            for response in responses:
                stream = self._streams.get(response.request_id)
                if stream is None:  # cancelled by its consumer: nothing more to say
                    continue
                stream.started = True
                if response.has_error():
                    logger.error("TensorRT-LLM request %s failed: %s", stream.request_id, response.error_msg)
                    del self._streams[response.request_id]
                    deliveries.append((stream, [], True, LLMError("engine_error", "the LLM engine failed")))
                    continue
                result = response.result
                codes, stop = speech_codes(result.output_token_ids[0], self._vocab)
                done = stop or result.is_final
                if done:
                    del self._streams[response.request_id]
                    if not result.is_final:
                        stopped.append(response.request_id)
                deliveries.append((stream, codes, done, None))
        for executor_id in stopped:
            self._executor.cancel_request(executor_id)
        return deliveries

    def _fail_all(self) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        failed = LLMError("engine_error", "the LLM engine failed")
        deliver_threadsafe(self._loop, [(stream, [], True, failed) for stream in streams])
