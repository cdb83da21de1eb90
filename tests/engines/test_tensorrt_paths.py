"""TensorRT-LLM and TensorRT paths up to the library boundary.

What runs here: the request translation and id mapping of the TensorRT-LLM engine, its asyncio bridge
over a stand-in executor that keeps the real bindings' call signatures, and the TensorRT pool's plan
layout and backend selection. Tests that need `tensorrt_llm` or `tensorrt` skip, saying so.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file

from engines.build.onnx_models import export_campplus
from engines.build.tensorrt import (
    StageUnavailable,
    TrtllmBuildOptions,
    build_trt,
    build_trtllm,
    convert_hf,
    export_onnx,
    trtllm_build_command,
)
from engines.build.tokenizer import write_qwen2_tokenizer
from engines.config import MANIFEST_NAME, ModelConfigs, ModelPaths
from engines.llm.auto import select_llm, tensorrt_llm_unavailable
from engines.llm.base import LLMError, LLMPrompt, LLMRequest, PromptMode, SamplingParams
from engines.llm.hf_export import SpeechVocab, is_exported
from engines.llm.model import CosyVoice2LM
from engines.llm.trtllm import (
    EngineLimits,
    TensorRTLLMUnavailable,
    TrtLlmConfig,
    TrtLlmEngine,
    plan_request,
    runtime_bias,
    speech_codes,
)
from engines.token2wav.auto import select_token2wav, tensorrt_unavailable
from engines.token2wav.flow_dit import DiTFlow, load_dit_flow
from engines.token2wav.onnx_export import CHUNK_INPUTS, OFFLINE_INPUTS, EstimatorShapes
from engines.token2wav.trt_pool import (
    EstimatorLimits,
    LeasePool,
    TrtArtifacts,
    TrtContextPool,
    TrtDiTEstimator,
    chunk_profile,
    offline_profile,
    outside,
)
from engines.voice import VoicePrompt

VOCAB = SpeechVocab(1000)
LIMITS = EngineLimits(max_batch_size=4, max_input_len=64, max_seq_len=128, vocab_size=VOCAB.padded_size,
                      logits_dtype=torch.float32)
HAS_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
HAS_TRT = importlib.util.find_spec("tensorrt") is not None
DIT = ModelConfigs.tiny().dit_flow.dit


def _request(text: int = 4, **sampling: Any) -> LLMRequest:
    return LLMRequest("r1", text_ids=list(range(10, 10 + text)), prompt_text_ids=[1, 2],
                      prompt_speech_tokens=[0, 6560], sampling=SamplingParams(**sampling))


# -- pure parts --------------------------------------------------------------------------------------


def test_importing_the_engine_does_not_import_tensorrt_llm() -> None:
    code = ("import sys, engines.llm.trtllm, engines.token2wav.trt_pool, engines.build.tensorrt\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'tensorrt', 'tensorrt_llm'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.skipif(HAS_TRTLLM, reason="tensorrt_llm is installed: the missing-library error cannot occur")
def test_constructing_without_tensorrt_llm_says_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(TensorRTLLMUnavailable, match="TensorRT-LLM is not importable"):
        TrtLlmEngine(TrtLlmConfig(tmp_path / "engine", tmp_path / "hf"))


def test_plan_builds_the_reference_prompt_and_stop_rules() -> None:
    plan = plan_request(_request(text=4, top_k=50, top_p=0.95, temperature=0.8, repetition_penalty=1.1),
                        VOCAB, LIMITS, seed=7)
    eos1, eos2, eos3 = VOCAB.eos_ids
    assert plan.input_ids == [VOCAB.sos_id, 1, 2, 10, 11, 12, 13, VOCAB.task_id, 1000, 7560]
    assert plan.end_id == eos1 and plan.stop_words == [[eos2], [eos3]] and plan.bad_words == []
    assert plan.max_tokens == 80  # 20 per text token
    assert plan.sampling == {"top_k": 50, "top_p": 0.95, "temperature": 0.8, "repetition_penalty": 1.1,
                             "seed": 7, "min_tokens": 8}


def test_plan_caps_the_length_at_the_engine_and_refuses_what_does_not_fit() -> None:
    assert plan_request(_request(text=6), VOCAB, LIMITS, seed=0).max_tokens == 128 - 12
    assert plan_request(_request(), VOCAB, LIMITS, seed=0).sampling["repetition_penalty"] is None
    with pytest.raises(LLMError) as too_long:
        plan_request(_request(text=60), VOCAB, LIMITS, seed=0)
    assert too_long.value.code == "context_too_long"
    bad = LLMRequest("r", text_ids=[VOCAB.text_vocab])
    with pytest.raises(LLMError) as invalid:
        plan_request(bad, VOCAB, LIMITS, seed=0)
    assert invalid.value.code == "invalid_request"


def test_fixed_length_plan_bans_every_eos_and_has_no_stop_word() -> None:
    plan = plan_request(_request(fixed_length=30), VOCAB, LIMITS, seed=0)
    assert plan.max_tokens == plan.sampling["min_tokens"] == 30
    assert plan.stop_words == [] and plan.bad_words == [[e] for e in VOCAB.eos_ids]


def test_output_ids_map_to_speech_codes_up_to_a_stop() -> None:
    assert speech_codes([1000, 7560, 1005], VOCAB) == ([0, 6560, 5], False)
    assert speech_codes([1003, VOCAB.eos_ids[1], 1004], VOCAB) == ([3], True)
    assert speech_codes([], VOCAB) == ([], False)


def test_head_bias_becomes_a_finite_embedding_bias_in_the_logits_dtype() -> None:
    bias = torch.full((VOCAB.padded_size,), float("-inf"), dtype=torch.bfloat16)
    bias[1000:1003] = torch.tensor([0.5, -1.0, 2.0])
    for dtype in (torch.float32, torch.float16):
        out = runtime_bias(bias, EngineLimits(1, 1, 2, VOCAB.padded_size, dtype))
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert out[0] == torch.finfo(dtype).min and out[1000:1003].tolist() == [0.5, -1.0, 2.0]
    with pytest.raises(ValueError, match="logits"):
        runtime_bias(bias[:-1], LIMITS)


def test_engine_limits_come_from_the_engine_config(tmp_path: Path) -> None:
    config = {"build_config": {"max_batch_size": 16, "max_input_len": 512, "max_seq_len": 2048},
              "pretrained_config": {"vocab_size": 158336, "logits_dtype": "float16"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert EngineLimits.read(tmp_path) == EngineLimits(16, 512, 2048, 158336, torch.float16)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not a TensorRT-LLM engine config"):
        EngineLimits.read(tmp_path)


# -- the engine over a stand-in executor ---------------------------------------------------------------


@dataclass
class _Live:
    request: Any
    script: list[int]
    sent: int = 0
    cancelled: bool = False


@dataclass
class FakeExecutorBindings:
    """The subset of `tensorrt_llm.bindings.executor` the engine uses, keyword-for-keyword.

    The executor streams one id per response from `script`; like TensorRT-LLM it leaves `end_id` out of
    the output, keeps a stop word in it, and ends a cancelled request with an empty final response.
    A request that has sent `hold_after` ids sends nothing more until it is cancelled.
    """

    script: list[int] = field(default_factory=list)
    hold_after: int | None = None
    live: dict[int, _Live] = field(default_factory=dict)
    cancelled: list[int] = field(default_factory=list)
    requests: list[Any] = field(default_factory=list)
    condition: threading.Condition = field(default_factory=threading.Condition)
    ModelType: Any = field(default_factory=lambda: SimpleNamespace(DECODER_ONLY="decoder_only"))

    @staticmethod
    def KvCacheConfig(
        *, enable_block_reuse: bool = True, free_gpu_memory_fraction: float | None = None
    ) -> Any:
        return SimpleNamespace(enable_block_reuse=enable_block_reuse, fraction=free_gpu_memory_fraction)

    @staticmethod
    def ExecutorConfig(*, max_beam_width: int = 1, kv_cache_config: Any = None) -> Any:
        return SimpleNamespace(max_beam_width=max_beam_width, kv_cache_config=kv_cache_config)

    @staticmethod
    def SamplingConfig(
        beam_width: int = 1, *, top_k: int | None = None, top_p: float | None = None,
        seed: int | None = None, temperature: float | None = None, min_tokens: int | None = None,
        repetition_penalty: float | None = None,
    ) -> Any:
        return SimpleNamespace(top_k=top_k, top_p=top_p, seed=seed, temperature=temperature,
                               min_tokens=min_tokens, repetition_penalty=repetition_penalty)

    @staticmethod
    def OutputConfig(*, exclude_input_from_output: bool = False) -> Any:
        return SimpleNamespace(exclude_input_from_output=exclude_input_from_output)

    @staticmethod
    def Request(input_token_ids: list[int], max_tokens: int, *, streaming: bool = False,
                sampling_config: Any = None, output_config: Any = None, end_id: int | None = None,
                pad_id: int | None = None, stop_words: list[list[int]] | None = None,
                bad_words: list[list[int]] | None = None, embedding_bias: torch.Tensor | None = None) -> Any:
        return SimpleNamespace(**locals())

    def Executor(self, model_path: str, model_type: Any, executor_config: Any) -> FakeExecutorBindings:
        assert isinstance(model_path, str) and model_type == "decoder_only"
        return self

    def enqueue_request(self, request: Any) -> int:
        with self.condition:
            executor_id = len(self.requests) + 100
            self.requests.append(request)
            self.live[executor_id] = _Live(request, list(self.script))
            self.condition.notify_all()
            return executor_id

    def cancel_request(self, executor_id: int) -> None:
        with self.condition:
            self.cancelled.append(executor_id)
            if executor_id in self.live:
                self.live[executor_id].cancelled = True
            self.condition.notify_all()

    def await_responses(self, timeout: Any) -> list[Any]:
        with self.condition:
            if not self._ready():
                self.condition.wait(timeout.total_seconds())
            return [self._step(executor_id) for executor_id in self._ready()]

    def _ready(self) -> list[int]:
        return [executor_id for executor_id, live in self.live.items()
                if live.cancelled or self.hold_after is None or live.sent < self.hold_after]

    def _step(self, executor_id: int) -> Any:
        live = self.live[executor_id]
        request = live.request
        if live.cancelled or live.sent >= len(live.script):
            del self.live[executor_id]
            return _response(executor_id, [], final=True)
        token = live.script[live.sent]
        live.sent += 1
        stop = [token] in (request.stop_words or [])
        final = token == request.end_id or stop or live.sent >= request.max_tokens
        if final:
            del self.live[executor_id]
        return _response(executor_id, [] if token == request.end_id else [token], final)

    def shutdown(self) -> None:
        with self.condition:
            self.live.clear()


def _response(executor_id: int, ids: list[int], final: bool) -> Any:
    result = SimpleNamespace(output_token_ids=[ids], is_final=final)
    return SimpleNamespace(request_id=executor_id, result=result, has_error=lambda: False, error_msg="")


@pytest.fixture
def engine_dirs(tmp_path: Path) -> TrtLlmConfig:
    hf, engine = tmp_path / "hf", tmp_path / "engine"
    hf.mkdir()
    engine.mkdir()
    VOCAB.save(hf)
    bias = torch.full((VOCAB.padded_size,), float("-inf"))
    bias[1000:1000 + 6564] = 0.25
    save_file({"lm_head.bias": bias.to(torch.bfloat16)}, str(hf / "model.safetensors"))
    config = {"build_config": {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128},
              "pretrained_config": {"vocab_size": VOCAB.padded_size, "logits_dtype": "float32"}}
    (engine / "config.json").write_text(json.dumps(config))
    return TrtLlmConfig(engine, hf, max_waiting=2, response_poll_ms=5)


async def _collect(stream: Any) -> list[int]:
    return [token for chunk in [c async for c in stream] for token in chunk]


async def test_engine_streams_speech_codes_until_a_stop_word(engine_dirs: TrtLlmConfig) -> None:
    fake = FakeExecutorBindings(script=[1000 + 5, 1000 + 6, 1000 + 7, VOCAB.eos_ids[2], 1000 + 8])
    engine = TrtLlmEngine(engine_dirs, bindings=fake)  # type: ignore[arg-type]
    await engine.start()
    try:
        stream = engine.submit(_request(seed=3))
        assert await asyncio.wait_for(_collect(stream), 5) == [5, 6, 7]
        request = fake.requests[0]
        assert request.streaming and request.output_config.exclude_input_from_output
        assert request.sampling_config.seed == 3 and request.sampling_config.min_tokens == 8
        assert request.embedding_bias.dtype == torch.float32 and torch.isfinite(request.embedding_bias).all()
        assert request.embedding_bias[1000].item() == 0.25
        assert engine.stats().active == 0 and engine.stats().waiting == 0
    finally:
        await engine.stop()


async def test_engine_ends_on_the_end_id_and_cancels_through_the_executor(engine_dirs: TrtLlmConfig) -> None:
    fake = FakeExecutorBindings(script=[1001, 1002, VOCAB.eos_ids[0]])
    engine = TrtLlmEngine(engine_dirs, bindings=fake)  # type: ignore[arg-type]
    await engine.start()
    try:
        assert await asyncio.wait_for(_collect(engine.submit(_request())), 5) == [1, 2]
        fake.script, fake.hold_after = [1001] * 50, 3
        stream = engine.submit(_request())
        received: list[int] = []
        while len(received) < 3:
            received += await asyncio.wait_for(stream.__anext__(), 5)
        assert received == [1, 1, 1]
        stream.cancel()
        assert fake.cancelled == [stream.executor_id]  # type: ignore[attr-defined]
        with pytest.raises(StopAsyncIteration):
            await stream.__anext__()
    finally:
        await engine.stop()


async def test_engine_refuses_when_too_many_wait_and_after_stop(engine_dirs: TrtLlmConfig) -> None:
    fake = FakeExecutorBindings(script=[1001] * 50, hold_after=0)  # nothing is ever scheduled
    engine = TrtLlmEngine(engine_dirs, bindings=fake)  # type: ignore[arg-type]
    with pytest.raises(LLMError) as not_started:
        engine.submit(_request())
    assert not_started.value.code == "not_running"
    await engine.start()
    streams = [engine.submit(_request()) for _ in range(2)]  # max_waiting=2: none has a response yet
    with pytest.raises(LLMError) as busy:
        engine.submit(_request())
    assert busy.value.code == "busy"
    await engine.stop()
    for stream in streams:
        with pytest.raises(LLMError) as stopped:
            await _collect(stream)
        assert stopped.value.code == "stopped"


# -- with the real library ----------------------------------------------------------------------------


@pytest.mark.tensorrt
def test_requests_are_accepted_by_the_real_bindings(engine_dirs: TrtLlmConfig) -> None:
    bindings = pytest.importorskip("tensorrt_llm.bindings.executor",
                                   reason="needs TensorRT-LLM (tensorrt_llm), not installed on this machine")
    engine = TrtLlmEngine(engine_dirs, bindings=bindings)
    engine._bias = runtime_bias(torch.zeros(VOCAB.padded_size), LIMITS)
    plan = plan_request(_request(seed=5, repetition_penalty=1.1), VOCAB, LIMITS, seed=5)
    request = engine._executor_request(plan)
    assert list(request.input_token_ids) == plan.input_ids and request.max_tokens == plan.max_tokens
    assert request.sampling_config.seed == 5 and request.end_id == VOCAB.eos_ids[0]


# -- build stages on a minimal tiny models directory ---------------------------------------------------


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The files the stages read: manifest size, llm.pt, the text tokenizer, the DiT flow.pt, CAMPPlus."""
    root = tmp_path_factory.mktemp("models")
    paths = ModelPaths(root)
    configs = ModelConfigs.tiny()
    (root / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    paths.llm.parent.mkdir(parents=True)
    paths.dit_flow.parent.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(CosyVoice2LM(configs.llm).state_dict(), paths.llm)
    torch.save(DiTFlow(configs.dit_flow).state_dict(), paths.dit_flow)
    write_qwen2_tokenizer(paths.text_tokenizer)
    export_campplus(paths.campplus, seed=0)
    return root


def test_convert_hf_stage_skips_what_is_current_and_redoes_what_is_stale(models_dir: Path) -> None:
    hf = ModelPaths(models_dir).hf_llm
    assert convert_hf(models_dir) is True and is_exported(hf)
    assert convert_hf(models_dir) is False
    assert convert_hf(models_dir, dtype="float32") is True  # other options: rebuilt
    llm = ModelPaths(models_dir).llm
    os.utime(llm, ns=(llm.stat().st_atime_ns, llm.stat().st_mtime_ns + 1))
    assert convert_hf(models_dir, dtype="float32") is True  # the source changed: rebuilt
    assert convert_hf(models_dir, dtype="float32", force=True) is True


def test_export_onnx_stage_writes_both_graphs_once(models_dir: Path) -> None:
    artifacts = TrtArtifacts(models_dir)
    assert export_onnx(models_dir) is True
    graphs = ((artifacts.dit_chunk_onnx, CHUNK_INPUTS), (artifacts.dit_offline_onnx, OFFLINE_INPUTS))
    for path, names in graphs:
        assert tuple(i.name for i in ort.InferenceSession(str(path)).get_inputs()) == names
    assert export_onnx(models_dir) is False
    artifacts.dit_offline_onnx.write_bytes(b"not onnx")
    assert export_onnx(models_dir) is True


@pytest.mark.skipif(HAS_TRTLLM, reason="tensorrt_llm is installed: the missing-library error cannot occur")
def test_build_trtllm_stage_says_what_it_needs(tmp_path: Path, models_dir: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    with pytest.raises(StageUnavailable, match="convert-hf"):
        build_trtllm(tmp_path, TrtllmBuildOptions())
    convert_hf(models_dir)
    with pytest.raises(StageUnavailable, match="TensorRT-LLM"):
        build_trtllm(models_dir, TrtllmBuildOptions())


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed: the missing-library error cannot occur")
def test_build_trt_stage_says_what_it_needs(tmp_path: Path, models_dir: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    with pytest.raises(StageUnavailable, match="export-onnx"):
        build_trt(tmp_path)
    export_onnx(models_dir)
    with pytest.raises(StageUnavailable, match="needs TensorRT"):
        build_trt(models_dir)


def test_trtllm_build_command_keeps_logits_in_float32() -> None:
    options = TrtllmBuildOptions(dtype="float16", max_batch_size=8, max_input_len=512, max_seq_len=2048,
                                 max_num_tokens=4096)
    command = trtllm_build_command(Path("ckpt"), Path("out"), options)
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "trtllm-build"
    assert flags == {"--checkpoint_dir": "ckpt", "--output_dir": "out", "--max_batch_size": "8",
                     "--max_input_len": "512", "--max_seq_len": "2048", "--max_num_tokens": "4096",
                     "--gemm_plugin": "float16", "--logits_dtype": "float32"}
    with pytest.raises(ValueError, match="max_input_len"):
        TrtllmBuildOptions(max_input_len=4096, max_seq_len=2048)


@pytest.mark.tensorrt
def test_build_trt_builds_plans_that_run(models_dir: Path) -> None:
    pytest.importorskip("tensorrt", reason="needs TensorRT (tensorrt) and a CUDA GPU, not available here")
    export_onnx(models_dir)
    limits = EstimatorLimits(streams=2, max_frames=64, max_cache_frames=64, max_offline_frames=128,
                             opt_frames=16, opt_cache_frames=16)
    assert build_trt(models_dir, "fp32", limits) is True
    assert build_trt(models_dir, "fp32", limits) is False
    pool = TrtContextPool(TrtArtifacts(models_dir).dit_chunk_plan("fp32"), size=2)
    flow = load_dit_flow(ModelPaths(models_dir).dit_flow, ModelConfigs.tiny().dit_flow, "cpu", torch.float32)
    feeds = {n: torch.randn(s) for n, s in EstimatorShapes(DIT).chunk_inputs(2, 8, 5).items()}
    feeds["t"] = torch.rand(2)
    out = pool({n: t.cuda() for n, t in feeds.items()})
    with torch.no_grad():
        expected = flow.decoder.estimator.forward_chunk(*feeds.values())
    for got, want in zip(out.values(), expected, strict=True):
        torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=1e-3)


# -- TensorRT pool parts that need no TensorRT -----------------------------------------------------------


def test_chunk_profile_spans_empty_caches_to_the_limits() -> None:
    limits = EstimatorLimits(streams=3, max_frames=100, max_cache_frames=200, opt_frames=20,
                             opt_cache_frames=50)
    profile = chunk_profile(DIT, limits)
    assert set(profile) == set(CHUNK_INPUTS)
    low, opt, high = profile["att_cache"]
    assert low == (DIT.depth, 2, DIT.num_heads, 0, 2 * DIT.head_dim)
    assert opt == (DIT.depth, 2, DIT.num_heads, 50, 2 * DIT.head_dim)
    assert high == (DIT.depth, 6, DIT.num_heads, 200, 2 * DIT.head_dim)
    assert profile["x"] == ((2, 80, 1), (2, 80, 20), (6, 80, 100))
    assert offline_profile(DIT, limits)["mask"][2] == (6, 1, 3000)


def test_inputs_outside_the_profile_are_named_with_the_limits() -> None:
    profile = chunk_profile(DIT, EstimatorLimits(streams=1, max_frames=10, max_cache_frames=10, opt_frames=5,
                                                 opt_cache_frames=5))
    inside = {n: torch.zeros(s) for n, s in EstimatorShapes(DIT).chunk_inputs(2, 10, 0).items()}
    assert outside(profile, inside) is None
    too_long = {n: torch.zeros(s) for n, s in EstimatorShapes(DIT).chunk_inputs(2, 11, 0).items()}
    assert str(outside(profile, too_long)).startswith("input x of shape (2, 80, 11) is outside")


@dataclass
class OrtPool:
    """Stands in for a `TrtContextPool`: the same exported graph and profile, run by onnxruntime."""

    plan: Path
    profile: dict[str, Any]
    calls: int = 0

    def __post_init__(self) -> None:
        self.session = ort.InferenceSession(str(self.plan), providers=["CPUExecutionProvider"])

    def __call__(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.calls += 1
        names = [o.name for o in self.session.get_outputs()]
        outputs = self.session.run(None, {n: t.numpy() for n, t in feeds.items()})
        return {n: torch.from_numpy(o) for n, o in zip(names, outputs, strict=True)}


@torch.no_grad()
def test_flow_on_the_plan_estimator_equals_the_pytorch_flow(models_dir: Path) -> None:
    """The DiT flow with `TrtDiTEstimator` over the exported graphs streams and renders the same mel;
    calls outside the profile fall back to the PyTorch DiT."""
    configs = ModelConfigs.tiny()
    reference = load_dit_flow(ModelPaths(models_dir).dit_flow, configs.dit_flow, "cpu", torch.float32)
    flow = load_dit_flow(ModelPaths(models_dir).dit_flow, configs.dit_flow, "cpu", torch.float32)
    export_onnx(models_dir)
    limits = EstimatorLimits(streams=1, max_frames=40, max_cache_frames=80, max_offline_frames=120,
                             opt_frames=20, opt_cache_frames=20)
    artifacts = TrtArtifacts(models_dir)
    chunk = OrtPool(artifacts.dit_chunk_onnx, chunk_profile(DIT, limits))
    offline = OrtPool(artifacts.dit_offline_onnx, offline_profile(DIT, limits))
    flow.decoder.estimator = TrtDiTEstimator(chunk, offline, fallback=flow.decoder.estimator)  # type: ignore[arg-type]

    generator = torch.Generator().manual_seed(3)
    voice = VoicePrompt("prompt", torch.randint(0, 6561, (6,), generator=generator),
                        torch.randn(192, generator=generator), torch.randn(12, 80, generator=generator))
    tokens = torch.randint(0, 6561, (30,), generator=generator)
    mels = []
    for model in (reference, flow):
        speaker = model.prepare_speaker(voice)
        stream = model.open_stream(speaker)
        first = model.chunk(stream, tokens[:8], last=False)  # 10 frames after a 12-frame prompt
        rest = model.chunk(stream, tokens[5:], last=True)  # 50 frames: beyond the 40-frame profile
        mels.append((first, rest, model.offline(speaker, tokens[:10])))
    for got, want in zip(mels[1], mels[0], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    steps = configs.dit_flow.n_timesteps
    assert chunk.calls == 2 * steps  # the prompt and the first chunk; the long last chunk fell back
    assert offline.calls == steps


def test_lease_pool_lends_each_item_to_one_thread_at_a_time() -> None:
    pool = LeasePool(["a", "b"])
    holders: list[str] = []
    lock = threading.Lock()
    peak = 0

    def work() -> None:
        nonlocal peak
        with pool.lease() as item, lock:
            holders.append(item)
            peak = max(peak, 2 - pool.available)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(holders) == 8 and set(holders) <= {"a", "b"} and peak <= 2 and pool.available == 2


async def test_lease_pool_hands_returned_items_to_waiting_coroutines() -> None:
    pool = LeasePool(["only"])
    order: list[str] = []
    release_first = asyncio.Event()

    async def first() -> None:
        async with pool.acquire() as item:
            order.append(f"first:{item}")
            await release_first.wait()

    async def second() -> None:
        async with pool.acquire() as item:
            order.append(f"second:{item}")

    tasks = [asyncio.create_task(first())]
    await asyncio.sleep(0)
    waiting = asyncio.create_task(second())
    cancelled = asyncio.create_task(second())
    await asyncio.sleep(0)
    cancelled.cancel()
    release_first.set()
    await asyncio.wait_for(asyncio.gather(*tasks, waiting), 5)
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert order == ["first:only", "second:only"] and pool.available == 1


# -- backend selection ---------------------------------------------------------------------------------------


def test_token2wav_selection_explains_why_tensorrt_is_not_used(models_dir: Path) -> None:
    assert "DiT flow only" in str(tensorrt_unavailable(models_dir, "unet", "cuda", "fp16"))
    assert "CUDA device" in str(tensorrt_unavailable(models_dir, "dit", "cpu", "fp16"))
    assert "missing" in str(tensorrt_unavailable(models_dir, "dit", "cuda", "fp16"))
    with pytest.raises(RuntimeError, match="CUDA device"):
        select_token2wav(models_dir, "tensorrt", device="cpu")


@pytest.mark.skipif(HAS_TRT, reason="tensorrt is installed")
def test_token2wav_selection_needs_the_library_when_plans_exist(tmp_path: Path) -> None:
    plan = TrtArtifacts(tmp_path).dit_chunk_plan("fp16")
    plan.parent.mkdir(parents=True)
    plan.write_bytes(b"plan")
    assert tensorrt_unavailable(tmp_path, "dit", "cuda", "fp16") == "the tensorrt package is not installed"


def test_llm_selection_explains_why_tensorrt_llm_is_not_used(models_dir: Path) -> None:
    assert "CUDA device" in str(tensorrt_llm_unavailable(models_dir, "cpu"))
    convert_hf(models_dir)
    assert "holds no engine" in str(tensorrt_llm_unavailable(models_dir, "cuda"))
    with pytest.raises(RuntimeError, match="cannot run"):
        select_llm(models_dir, "tensorrt_llm", device="cpu")


async def test_engine_enqueues_each_modes_prompt_and_refuses_modes_it_does_not_serve(
        engine_dirs: TrtLlmConfig) -> None:
    instruct = LLMPrompt(PromptMode.INSTRUCT2, (5, 6, 7), ())
    cross = LLMPrompt(PromptMode.CROSS_LINGUAL, (), ())
    fake = FakeExecutorBindings(script=[1001, VOCAB.eos_ids[0]])
    config = dataclasses.replace(engine_dirs, modes=frozenset({PromptMode.ZERO_SHOT, PromptMode.INSTRUCT2}))
    engine = TrtLlmEngine(config, bindings=fake)  # type: ignore[arg-type]
    await engine.start()
    try:
        stream = engine.submit(instruct.request("i", [10, 11], SamplingParams()))
        assert await asyncio.wait_for(_collect(stream), 5) == [1]
        assert fake.requests[0].input_token_ids == [VOCAB.sos_id, 5, 6, 7, 10, 11, VOCAB.task_id]
        with pytest.raises(LLMError) as refused:
            engine.submit(cross.request("c", [10], SamplingParams()))
        assert refused.value.code == "mode_not_supported" and len(fake.requests) == 1
    finally:
        await engine.stop()
