"""TorchLLMEngine end to end on the CPU with a tiny random CosyVoice2 LM."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.config import MANIFEST_NAME, SPEECH_CODEBOOK, SPEECH_EOS, ModelConfigs, ModelPaths
from engines.llm.base import LLMError, LLMRequest, SamplingParams, TokenStream
from engines.llm.model import CosyVoice2LM
from engines.llm.sampling import MAX_TOP_K
from engines.llm.torch_engine import TorchLLMConfig, TorchLLMEngine
from engines.llm.torch_runner import Readback, ReadbackRing

TINY = ModelConfigs.tiny().llm
CONFIG = TorchLLMConfig(device="cpu", max_slots=4, max_context=160, max_waiting=16, prefill_chunk=24,
                        min_kv_bucket=32)


def tiny_loader(eos_bias: float = 0.0) -> Callable[[torch.device, torch.dtype], CosyVoice2LM]:
    def load(device: torch.device, dtype: torch.dtype) -> CosyVoice2LM:
        torch.manual_seed(0)
        model = CosyVoice2LM(TINY)
        with torch.no_grad():
            model.llm_decoder.bias[SPEECH_EOS] += eos_bias
        return model.to(device, dtype).eval().requires_grad_(False)

    return load


@contextlib.asynccontextmanager
async def running(config: TorchLLMConfig = CONFIG, eos_bias: float = 0.0) -> AsyncIterator[TorchLLMEngine]:
    engine = TorchLLMEngine(config, tiny_loader(eos_bias))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def request(request_id: str, text_len: int = 4, speech_len: int = 10, **sampling: object) -> LLMRequest:
    return LLMRequest(
        request_id=request_id,
        text_ids=list(range(100, 100 + text_len)),
        prompt_text_ids=[7, 8, 9],
        prompt_speech_tokens=[(13 * i) % SPEECH_CODEBOOK for i in range(speech_len)],
        sampling=SamplingParams(**sampling),  # type: ignore[arg-type]
    )


async def seeded_tokens(config: TorchLLMConfig, count: int, length: int,
                        sampling: Callable[[int], dict[str, object]] = lambda _: {}) -> list[list[int]]:
    """The tokens of `count` seeded fixed-length requests (request i: `length + i` tokens, `sampling(i)`)
    submitted together to an engine of `config`."""
    async with running(config) as engine:
        streams = [engine.submit(request(f"r{i}", speech_len=7 * i, fixed_length=length + i, seed=i,
                                         **sampling(i)))
                   for i in range(count)]
        return await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)


async def collect(stream: TokenStream) -> list[int]:
    tokens: list[int] = []
    async for chunk in stream:
        assert chunk
        tokens.extend(chunk)
    return tokens


async def until_idle(engine: TorchLLMEngine) -> None:
    # Stats are a snapshot the engine thread publishes; there is no event to wait on.
    while engine.stats().active or engine.stats().waiting:  # noqa: ASYNC110
        await asyncio.sleep(0.005)


async def test_concurrent_requests_get_their_fixed_length_in_the_codebook() -> None:
    lengths = [5, 17, 1, 30, 12, 8, 25, 3, 9, 20]
    async with running() as engine:
        streams = [engine.submit(request(f"r{i}", speech_len=3 * i, fixed_length=n, seed=i))
                   for i, n in enumerate(lengths)]
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        assert [len(tokens) for tokens in results] == lengths
        assert all(0 <= t < SPEECH_CODEBOOK for tokens in results for t in tokens)
        await asyncio.wait_for(until_idle(engine), 10)
        assert engine.stats().kv_tokens_used == 0


async def test_stop_tokens_end_the_stream_after_the_minimum_length() -> None:
    # eos dominates the logits: it is banned for the first int(2 * 3) tokens and sampled right after.
    async with running(eos_bias=50.0) as engine:
        tokens = await asyncio.wait_for(collect(engine.submit(request("eos", text_len=3))), 30)
    assert len(tokens) == 6
    assert all(0 <= t < SPEECH_CODEBOOK for t in tokens)


async def test_generation_stops_at_the_maximum_length() -> None:
    async with running(eos_bias=-50.0) as engine:
        stream = engine.submit(request("max", text_len=2, min_token_ratio=0.0, max_token_ratio=6.0))
        tokens = await asyncio.wait_for(collect(stream), 30)
    assert len(tokens) == 12


async def test_a_seeded_request_is_the_same_alone_and_batched() -> None:
    async with running() as engine:
        alone = await asyncio.wait_for(collect(engine.submit(request("a", fixed_length=20, seed=42))), 30)
        streams = [engine.submit(request(f"b{i}", text_len=2 + i, fixed_length=15 + i)) for i in range(3)]
        streams.insert(1, engine.submit(request("a", fixed_length=20, seed=42)))
        results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
        stats = engine.stats()
    assert results[1] == alone
    # Five prompts, each within one chunk: five rows, the four submitted together in one or more calls.
    assert stats.prefill_rows == 5 and 2 <= stats.prefill_calls <= 5


async def read_until(stream: TokenStream, count: int) -> list[int]:
    tokens: list[int] = []
    while len(tokens) < count:
        tokens.extend(await anext(stream))
    return tokens


async def test_a_paced_request_pauses_at_what_its_consumer_wants_and_resumes_when_asked() -> None:
    async with running() as engine:
        paced = engine.submit(request("paced", fixed_length=60, seed=3))
        paced.want(10)
        tokens = await asyncio.wait_for(anext(paced), 30)  # woken once, with all it wanted
        await asyncio.sleep(0.1)  # the step that handed over the last token finishes
        steps = engine.stats().steps
        await asyncio.sleep(0.3)  # paused: no step runs while nobody wants tokens
        assert engine.stats().steps == steps
        assert len(tokens) == 10 and engine.stats().active == 1
        paced.want(25)
        tokens += await asyncio.wait_for(read_until(paced, 15), 30)
        assert len(tokens) == 25
        # A request without pacing decodes to its end; the paced one rides along in its batches.
        free = await asyncio.wait_for(collect(engine.submit(request("free", fixed_length=40, seed=4))), 30)
        assert len(free) == 40
        paced.want(60)
        tokens += await asyncio.wait_for(collect(paced), 30)
    assert len(tokens) == 60
    # Pausing changes nothing in what is sampled.
    async with running() as engine:
        unpaced = engine.submit(request("x", fixed_length=60, seed=3))
        assert await asyncio.wait_for(collect(unpaced), 30) == tokens


async def test_cancel_close_and_consumer_cancellation_free_the_slots() -> None:
    async with running() as engine:
        long = {"fixed_length": 120}
        cancelled, closed, queued = (engine.submit(request(name, **long)) for name in ("c", "d", "e"))
        consumed = engine.submit(request("f", **long))
        assert await anext(cancelled) and await anext(closed)
        cancelled.cancel()
        cancelled.cancel()  # idempotent
        await closed.aclose()
        queued.cancel()
        with pytest.raises(StopAsyncIteration):
            await anext(cancelled)

        started = asyncio.Event()

        async def consume() -> None:
            async for _ in consumed:
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(until_idle(engine), 10)
        assert engine.stats().active == 0
        # The freed slots serve new requests.
        assert len(await asyncio.wait_for(collect(engine.submit(request("g", fixed_length=4))), 30)) == 4


async def test_bad_requests_fail_clearly() -> None:
    engine = TorchLLMEngine(CONFIG, tiny_loader())
    with pytest.raises(LLMError) as not_running:
        engine.submit(request("early"))
    assert not_running.value.code == "not_running"
    async with running(TorchLLMConfig(device="cpu", max_slots=1, max_waiting=1, max_context=160)) as engine:
        with pytest.raises(LLMError) as too_long:
            engine.submit(request("long", text_len=40, speech_len=120))
        assert too_long.value.code == "context_too_long"
        assert "160" in str(too_long.value)
        bad_requests = (
            LLMRequest("text", text_ids=[TINY.qwen.vocab_size]),
            LLMRequest("speech", text_ids=[1], prompt_speech_tokens=[SPEECH_CODEBOOK]),
            request("ras", ras_window=1000),
            request("top_k", top_k=MAX_TOP_K + 1),
            request("empty", max_token_ratio=0.0, min_token_ratio=0.0),
        )
        for bad in bad_requests:
            with pytest.raises(LLMError) as invalid:
                engine.submit(bad)
            assert invalid.value.code == "invalid_request"
        # One slot and one waiting place: a third long request cannot be queued.
        with pytest.raises(LLMError) as busy:
            for i in range(3):
                engine.submit(request(f"busy{i}", fixed_length=100))
        assert busy.value.code == "busy"


async def test_an_engine_failure_fails_only_the_affected_stream() -> None:
    async with running() as engine:
        runner = engine._runner
        assert runner is not None
        original = runner.begin

        def begin(seqs: Sequence[Any]) -> list[torch.Tensor]:
            if any(seq.request.request_id == "broken" for seq in seqs):
                raise RuntimeError("injected failure")
            return original(seqs)

        runner.begin = begin  # type: ignore[method-assign]
        broken = engine.submit(request("broken", fixed_length=10))
        healthy = engine.submit(request("healthy", fixed_length=10))
        with pytest.raises(LLMError) as failure:
            await asyncio.wait_for(collect(broken), 30)
        assert failure.value.code == "engine_error"
        assert len(await asyncio.wait_for(collect(healthy), 30)) == 10
        await asyncio.wait_for(until_idle(engine), 10)


async def test_stop_ends_the_streams_in_flight() -> None:
    engine = TorchLLMEngine(CONFIG, tiny_loader())
    await engine.start()
    stream = engine.submit(request("late", fixed_length=120))
    assert await anext(stream)
    await engine.stop()
    with pytest.raises(LLMError) as stopped:
        while True:
            await asyncio.wait_for(anext(stream), 10)
    assert stopped.value.code == "stopped"


async def test_from_models_dir_loads_the_checkpoint_of_the_manifest_size(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    checkpoint = ModelPaths(tmp_path).llm
    checkpoint.parent.mkdir(parents=True)
    torch.save(tiny_loader()(torch.device("cpu"), torch.float32).state_dict(), checkpoint)
    engine = TorchLLMEngine.from_models_dir(tmp_path, device="cpu", max_slots=2, max_context=128)
    await engine.start()
    try:
        tokens = await asyncio.wait_for(collect(engine.submit(request("dir", fixed_length=7))), 30)
    finally:
        await engine.stop()
    assert len(tokens) == 7
    assert engine.stats().max_slots == 2


def test_prefill_calls_are_the_smallest_padded_shape_within_the_position_budget() -> None:
    config = TorchLLMConfig(prefill_chunk=512, prefill_tokens=2048, prefill_rows=(1, 2, 4, 8))
    assert config.prefill_lengths == (64, 128, 192, 256, 320, 384, 448, 512)
    assert all(rows * length <= 2048 for rows, length in config.prefill_shapes)
    assert config.prefill_shape(3, 300) == (4, 320)
    assert config.prefill_shape(8, 200) == (8, 256)
    assert config.prefill_shape(5, 300) is None  # 8 rows of 320 positions exceed the budget
    with pytest.raises(ValueError, match="prefill_tokens"):
        TorchLLMConfig(prefill_chunk=512, prefill_tokens=256)


def test_a_prefill_call_pads_rows_only_up_to_its_limit() -> None:
    """Past `prefill_padding_limit` padded positions a call takes the prompts of the next smaller row
    bucket; the rest wait for the next step. Without a limit every prompt in line goes at once."""
    unlimited = TorchLLMConfig(prefill_chunk=512, prefill_tokens=8192)
    assert unlimited.prefill_prompts_taken(17, 192) == 17  # one call of 32 rows
    limited = dataclasses.replace(unlimited, prefill_padding_limit=1024)
    assert limited.prefill_shape(17, 192) == (32, 192)
    assert limited.prefill_prompts_taken(17, 192) == 16  # 15 padded rows of 192: 2880 positions
    assert limited.prefill_prompts_taken(30, 192) == 30  # 2 padded rows: 384 positions
    assert limited.prefill_prompts_taken(3, 192) == 3  # 1 padded row
    assert limited.prefill_prompts_taken(16, 192) == 16  # no padding
    exact = dataclasses.replace(unlimited, prefill_padding_limit=0)
    assert [exact.prefill_prompts_taken(n, 64) for n in (1, 3, 5, 12, 31)] == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="prefill_padding_limit"):
        TorchLLMConfig(prefill_padding_limit=-1)


async def test_prompts_left_for_the_next_prefill_call_sample_the_same_tokens() -> None:
    """Prefilled in calls of exact row buckets (limit 0) or padded together: the same tokens per seed."""
    results = []
    for limit in (None, 0):
        config = dataclasses.replace(CONFIG, max_slots=8, prefill_rows=(1, 2, 4, 8),
                                     prefill_padding_limit=limit)
        async with running(config) as engine:
            streams = [engine.submit(request(f"r{i}", text_len=2 + i, fixed_length=12, seed=i))
                       for i in range(7)]
            results.append(await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60))
            assert engine.stats().prefill_rows == 7
    assert results[0] == results[1]


def test_prefill_graphs_attend_to_one_length_up_to_their_limit() -> None:
    config = TorchLLMConfig(max_context=2048, min_kv_bucket=256, prefill_graph_kv=512)
    assert config.prefill_graph_kv_len == 512
    needed = (1, 256, 257, 512, 513, 1500)
    assert [config.prefill_kv_len(n) for n in needed] == [512, 512, 512, 512, 1024, 2048]
    assert TorchLLMConfig(max_context=160, min_kv_bucket=32).prefill_graph_kv_len == 160


async def test_prefill_over_a_longer_padded_cache_samples_the_same_tokens() -> None:
    """Prefill calls of later chunks (prompts of 29-56 positions, chunks of 24) attend through the cache
    at the graphs' one length or the bucket holding them (masked past each position), not the shortest
    bucket: the tokens are those of the shortest bucket."""
    results = []
    for graph_kv in (32, 160):  # CONFIG's cache buckets: 32, 64, 128, 160
        config = dataclasses.replace(CONFIG, prefill_graph_kv=graph_kv)
        assert config.prefill_kv_len(20) == graph_kv and config.prefill_kv_len(56) == max(graph_kv, 64)
        async with running(config) as engine:
            streams = [engine.submit(request(f"p{i}", speech_len=20 + 9 * i, fixed_length=12, seed=i))
                       for i in range(4)]
            results.append(await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60))
    assert results[0] == results[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_cuda_graphs_replay_the_eager_computation() -> None:
    results = {graphs: await seeded_tokens(dataclasses.replace(CONFIG, device="cuda", cuda_graphs=graphs),
                                           6, 20)
               for graphs in (True, False)}
    assert [len(tokens) for tokens in results[True]] == [20 + i for i in range(6)]
    assert results[True] == results[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_the_fused_sampler_samples_the_eager_tokens() -> None:
    """Prefill and decode graphs with the one-kernel sampler (engines/llm/sampling_kernel.py) against the
    eager sampler, RAS off (its fallback draws over the whole vocabulary, where fp32 scans in another
    order may part by a token: tests/engines/test_llm_sampling_kernel.py checks it against float64)."""
    def sampling(i: int) -> dict[str, object]:
        return {"use_ras": False, "top_p": 0.9 - 0.1 * i, "temperature": 0.8 + 0.1 * i}

    results = {fused: await seeded_tokens(dataclasses.replace(CONFIG, device="cuda", fused_sampling=fused), 5,
                                          30, sampling)
               for fused in (True, False)}
    assert [len(tokens) for tokens in results[True]] == [30 + i for i in range(5)]
    assert results[True] == results[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_programmatic_launch_samples_the_tokens_of_plain_launches() -> None:
    """The decode kernels launched with programmatic dependent launch sample exactly the tokens of plain
    launches (elsewhere the engine launches plainly both times: nothing to compare)."""
    from engines.llm import programmatic_launch

    if not programmatic_launch.supported(torch.device("cuda")):
        pytest.skip("this GPU or Triton has no programmatic dependent launch")
    results = {programmatic: await seeded_tokens(
                   dataclasses.replace(CONFIG, device="cuda", programmatic_launch=programmatic), 5, 25)
               for programmatic in (True, False)}
    assert results[True] == results[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
async def test_kept_elementwise_functions_sample_what_the_compiled_ones_do(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The fused rope / SwiGLU / RMSNorm kept ahead of time (`precompiled`, the service's compile cache):
    an engine that compiles them into the folder and one that then loads them sample the tokens of an
    engine compiling them in-process; the second compiles nothing. Prompts past the prefill graphs'
    keys prefill eagerly (under no_grad): the variants the graphs' capture compiled serve them too (a
    capture run with grad on compiled variants those calls' guards refused)."""
    from engines.precompiled import PrecompiledFunction

    results, compiled = [], []
    for precompiled in (None, tmp_path, tmp_path):
        config = dataclasses.replace(CONFIG, device="cuda", precompiled=precompiled, prefill_graph_kv=16)
        async with running(config) as engine:
            streams = [engine.submit(request(f"k{i}", speech_len=7 * i, fixed_length=20 + i, seed=i))
                       for i in range(6)]
            results.append(await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60))
            assert engine._runner is not None
            ops = engine._runner.model.backbone.ops
            kernels = [ops.rope_, ops.silu_mul, ops.rms_norm]
            if precompiled is not None:
                assert all(isinstance(kernel, PrecompiledFunction) for kernel in kernels)
                compiled.append(sum(kernel.compiled for kernel in kernels))  # type: ignore[attr-defined]
    assert compiled[0] > 0 and compiled[1] == 0
    assert results[1] == results[0] and results[2] == results[0]
    missed = [record for record in caplog.records if "not compiled before the warm-up" in record.getMessage()]
    assert not missed


def test_read_backs_alternate_buffers_so_the_one_in_flight_keeps_its_tokens() -> None:
    tokens = torch.arange(6)
    ring = ReadbackRing(tokens)
    first = Readback(*ring.start(), prefill_rows=2, decode_rows=3, decode_offset=2)
    tokens += 10  # the next step's tokens, read back while the first is still unread
    second = Readback(*ring.start(), prefill_rows=1, decode_rows=4, decode_offset=2)
    assert first.lists() == ([0, 1], [2, 3, 4])
    assert second.lists() == ([10], [12, 13, 14, 15])
