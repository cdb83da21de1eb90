"""Batched token2wav: chunks of many streams in one padded computation equal each stream run alone.

Streams differ in chunk length, cache length, voice (prompt length) and phase (first, middle, last and
empty last chunks). Batched and alone runs share the weights, noise columns and vocoder seeds, so they
differ only by float reassociation: padded matmuls and a softmax over extra masked keys sum in another
order. Over 10 Euler steps that stays ~1e-6 on mel values ~1 in fp32; 1e-4 leaves room for other BLAS
builds while any leak of padding (magnitude 100 in the stale-buffer test) would be orders larger.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from weights import randomize

from engines.config import PRE_LOOKAHEAD, SAMPLES_PER_TOKEN, ModelConfigs
from engines.token2wav.base import ChunkJob, SpeakerState
from engines.token2wav.batching import Buckets, EncodeShape, RowSpec, SolveShape, plan_batches, span_mask
from engines.token2wav.cfm import RaggedInputs, RaggedOutputs
from engines.token2wav.conformer import ConformerCache
from engines.token2wav.flow_dit import DiTFlow, DiTSpeaker, DiTStream
from engines.token2wav.graphs import EagerEncoder, EncoderInputs, EncoderLayout, EncoderOutputs, SolverLayout
from engines.token2wav.hift import HiFTGenerator
from engines.token2wav.solve_memory import SolveMemory
from engines.token2wav.torch_backend import (
    FLOW_GRAPH_BATCHES,
    GRAPH_HOPS,
    TorchStream,
    TorchToken2Wav,
    compile_worker_count,
    flow_graph_buckets,
    other_first_hops,
    schedule_hops,
    vocoder_graph_chunks,
)
from engines.token2wav.warmup_shapes import first_chunk_solve_shapes, later_graph_shapes, planned_solve_shapes
from engines.voice import VoicePrompt

CONFIGS = ModelConfigs.tiny()
ATOL = RTOL = 1e-4
# On CUDA float32 matmuls run on TF32 tensor cores (the service's setting, tests/conftest.py): eager and
# compiled kernels round differently, by ~2e-3 at most over a whole solve on an H100 (the tolerance of
# 1e-4 failed there with 2.1e-3); a wrong buffer or a stale graph input is off by O(1).
TF32_ATOL = TF32_RTOL = 5e-3



def make_voice(seed: int, tokens: int) -> VoicePrompt:
    generator = torch.Generator().manual_seed(seed)
    return VoicePrompt(
        prompt_text="prompt",
        speech_tokens=torch.randint(0, CONFIGS.dit_flow.vocab_size, (tokens,), generator=generator),
        speaker_embedding=torch.randn(192, generator=generator),
        prompt_mel=torch.randn(2 * tokens, 80, generator=generator),
    )


@dataclass(frozen=True)
class Plan:
    """One stream: its voice, its tokens and its hops (then a last chunk with the rest)."""

    voice: int
    tokens: torch.Tensor
    hops: tuple[int, ...]

    def chunks(self) -> list[tuple[torch.Tensor, bool]]:
        pieces, start = [], 0
        for hop in self.hops:
            pieces.append((self.tokens[start : start + hop + PRE_LOOKAHEAD], False))
            start += hop
        pieces.append((self.tokens[start:], True))
        return pieces


def plans() -> list[Plan]:
    """Mixed chunk lengths, cache lengths, voices and phases; two streams with equal shapes throughout
    (so that HiFT batches them) and an utterance without tokens (one empty final chunk)."""
    generator = torch.Generator().manual_seed(7)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, CONFIGS.dit_flow.vocab_size, (n,), generator=generator)

    return [
        Plan(0, tokens(31), (8, 5)),
        Plan(1, tokens(23), (15,)),
        Plan(0, tokens(9), ()),
        Plan(1, tokens(15), (4, 4, 4)),
        Plan(0, tokens(24), (10,)),
        Plan(1, tokens(24), (10,)),
        Plan(0, tokens(0), ()),
    ]


def rounds(items: list[list[tuple[torch.Tensor, bool]]]) -> Iterator[list[int]]:
    """Indices of the streams with a chunk in each round (round k = every stream's k-th chunk)."""
    for k in range(max(len(chunks) for chunks in items)):
        yield [i for i, chunks in enumerate(items) if k < len(chunks)]


# The released R = 100 never trims these short streams; R = 10 trims them at almost every chunk (prompts
# of 24 and 14 frames), so rows with partly dropped prompts and own caches share the batches.
TRIMMING = dataclasses.replace(CONFIGS.dit_flow, att_cache_recent_frames=10)


@pytest.fixture(scope="module")
def flow() -> DiTFlow:
    model = DiTFlow(CONFIGS.dit_flow).eval()
    randomize(model, seed=0)
    return model


@pytest.fixture(scope="module")
def trimming_flow() -> DiTFlow:
    model = DiTFlow(TRIMMING).eval()
    randomize(model, seed=0)
    return model


@pytest.fixture(scope="module")
def speakers(flow: DiTFlow) -> list[DiTSpeaker]:
    return [flow.prepare_speaker(make_voice(1, 12)), flow.prepare_speaker(make_voice(2, 7))]


def alone_mels(flow: DiTFlow, speakers: list[DiTSpeaker], plan: Plan) -> list[torch.Tensor]:
    """The one-stream path (the estimator's forward_chunk)."""
    stream = flow.open_stream(speakers[plan.voice])
    return [flow.chunk(stream, tokens, last) for tokens, last in plan.chunks()]


def batched_mels(flow: DiTFlow, speakers: list[DiTSpeaker], streams: list[Plan]) -> list[list[torch.Tensor]]:
    opened = [flow.open_stream(speakers[plan.voice]) for plan in streams]
    chunks = [plan.chunks() for plan in streams]
    mels: list[list[torch.Tensor]] = [[] for _ in streams]
    for active in rounds(chunks):
        k = len(mels[active[0]])
        out = flow.chunks([opened[i] for i in active], [chunks[i][k][0] for i in active],
                          [chunks[i][k][1] for i in active])
        for i, mel in zip(active, out, strict=True):
            mels[i].append(mel)
    return mels


def assert_streams_match(flow: DiTFlow, speakers: list[DiTSpeaker], streams: list[Plan]) -> None:
    batched = batched_mels(flow, speakers, streams)
    for plan, got in zip(streams, batched, strict=True):
        want = alone_mels(flow, speakers, plan)
        assert [m.shape for m in got] == [m.shape for m in want]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def test_batched_flow_chunks_equal_each_stream_alone(flow: DiTFlow, speakers: list[DiTSpeaker]) -> None:
    assert_streams_match(flow, speakers, plans())


def test_batched_trimmed_caches_equal_each_stream_alone(trimming_flow: DiTFlow) -> None:
    """Under the reference's trim (test_dit_flow checks the one-stream path against its definition)."""
    speakers = [trimming_flow.prepare_speaker(make_voice(1, 12)),
                trimming_flow.prepare_speaker(make_voice(2, 7))]
    assert_streams_match(trimming_flow, speakers, plans())
    stream = trimming_flow.open_stream(speakers[0])
    for tokens, last in plans()[0].chunks():
        trimming_flow.chunks([stream], [tokens], [last])
    assert stream.keys.prompt is not None  # part of the prompt was dropped


@pytest.mark.parametrize("recent", [10, 0])
def test_streams_in_step_share_their_keys_and_equal_each_stream_alone(recent: int) -> None:
    """Streams of one voice opened together move through the same keys objects (`DiTSpeaker.keys`): the
    batch fills their prompt mask and kept positions per group, beside a stream of another voice; with
    R = 0 the trim drops the whole prompt."""
    model = DiTFlow(dataclasses.replace(CONFIGS.dit_flow, att_cache_recent_frames=recent)).eval()
    randomize(model, seed=0)
    speakers = [model.prepare_speaker(make_voice(1, 12)), model.prepare_speaker(make_voice(2, 7))]
    steady = plans()[0]
    streams = [dataclasses.replace(steady, voice=0)] * 3 + [dataclasses.replace(steady, voice=1)]
    opened = [model.open_stream(speakers[plan.voice]) for plan in streams]
    assert opened[0].keys is opened[1].keys is opened[2].keys is not opened[3].keys
    assert_streams_match(model, speakers, streams)
    if recent == 0:
        stream = model.open_stream(speakers[0])
        for tokens, last in steady.chunks():
            model.chunks([stream], [tokens], [last])
        assert stream.keys.prompt == ()  # the whole prompt was dropped


class PersistentSolver:
    """What CUDA graphs impose, on the CPU: one set of input buffers per shape, kept across calls and
    starting as large garbage, so any padding the batch fails to mask or overwrite would show."""

    def __init__(self, flow: DiTFlow, keep_outputs: bool = False) -> None:
        self.flow = flow
        self.layout = SolverLayout.of(flow.cfg, flow.dtype, flow.device)
        self.inputs: dict[SolveShape, RaggedInputs] = {}
        # keep_outputs: one set of output buffers per shape too, overwritten by every call (as a graph's)
        self.outputs: dict[SolveShape, RaggedOutputs] | None = {} if keep_outputs else None
        self.runs: list[SolveShape] = []

    def buffers(self, shape: SolveShape) -> RaggedInputs:
        if shape not in self.inputs:
            generator = torch.Generator().manual_seed(len(self.inputs))
            garbage = {name: (100 * torch.randn(size, generator=generator)).to(dtype)
                       for name, (size, dtype) in self.layout.input_specs(shape).items()}
            self.inputs[shape] = RaggedInputs(**garbage)
        return self.inputs[shape]

    def run(self, shape: SolveShape) -> RaggedOutputs:
        self.runs.append(shape)
        if self.outputs is None:
            return self.flow.decoder.solve_ragged(self.inputs[shape])
        out = self.outputs.get(shape)
        self.outputs[shape] = self.flow.decoder.solve_ragged(self.inputs[shape], out)
        return self.outputs[shape]


class PersistentEncoder:
    """`PersistentSolver` for the encoder: per shape, garbage input buffers kept across calls."""

    def __init__(self, flow: DiTFlow, keep_outputs: bool = False) -> None:
        self.layout = EncoderLayout(flow.cfg.encoder, flow.cfg.output_size, flow.dtype, flow.device)
        self.encode = EagerEncoder(flow._encode_inputs, self.layout).encode
        self.inputs: dict[EncodeShape, EncoderInputs] = {}
        self.outputs: dict[EncodeShape, EncoderOutputs] | None = {} if keep_outputs else None
        self.runs: list[EncodeShape] = []

    def buffers(self, shape: EncodeShape) -> EncoderInputs:
        if shape not in self.inputs:
            generator = torch.Generator().manual_seed(len(self.inputs))

            def garbage(name: str, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                return (100 * torch.randn(size, generator=generator)).to(dtype)

            self.inputs[shape] = self.layout.inputs(shape, garbage)
        return self.inputs[shape]

    def run(self, shape: EncodeShape) -> EncoderOutputs:
        self.runs.append(shape)
        mu, update = self.encode(self.inputs[shape])
        if self.outputs is None:
            return EncoderOutputs(mu, update)
        kept = self.outputs.setdefault(shape, EncoderOutputs(torch.empty_like(mu), ConformerCache(
            *(torch.empty_like(t) for t in (update.lookahead, update.upsample, update.token_kv,
                                            update.frame_kv)))))
        kept.mu.copy_(mu)
        for buffer, fresh in zip((kept.update.lookahead, kept.update.upsample, kept.update.token_kv,
                                  kept.update.frame_kv),
                                 (update.lookahead, update.upsample, update.token_kv, update.frame_kv),
                                 strict=True):
            buffer.copy_(fresh)
        return kept


def test_bucketed_shapes_with_stale_buffers_equal_each_stream_alone() -> None:
    """Padded rows, frames, own caches, kept frames, prompt frames and encoder histories, on buffers
    reused between calls, with caches trimmed; a first chunk of the 20-frame bucket in the padding row of a
    30-frame one's 40-frame solve (`plan_batches`)."""
    flow = DiTFlow(TRIMMING).eval()
    randomize(flow, seed=0)
    speakers = [flow.prepare_speaker(make_voice(1, 12)), flow.prepare_speaker(make_voice(2, 7))]
    solver, encoder = PersistentSolver(flow), PersistentEncoder(flow)
    buckets = Buckets(batch=(2, 8), frames=(20, 40, 80), prompt_frames=(64,), own_frames=(16, 32, 64),
                      history_tokens=(16, 48, 96))
    flow.use_bucketed_solver(solver, buckets, encoder)
    assert_streams_match(flow, speakers, plans())
    assert SolveShape(2, 40, 0, 64, 16) in solver.runs
    assert {s.batch for s in encoder.runs} >= {2, 8} and len({s.history for s in encoder.runs}) > 1
    assert len(encoder.inputs) < len(encoder.runs)
    assert {s.prompt_frames for s in solver.runs} == {64}
    assert {s.own_frames for s in solver.runs} >= {0, 32}
    assert len({s.kept_frames for s in solver.runs}) > 1
    assert {s.batch for s in solver.runs} >= {2, 8}
    assert len(solver.inputs) < len(solver.runs)  # buffers were reused


def test_calls_padded_to_a_stand_in_holding_them_equal_each_stream_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every solve and encode at one larger shape holding them all (what `ShapeGraphs.stand_in` picks while
    the warm-up has not reached a call's own bucket): first chunks in a shape with an own cache, rows,
    frames, prompts, kept frames and histories all padded past their buckets, on reused garbage buffers."""
    flow = DiTFlow(TRIMMING).eval()
    randomize(flow, seed=0)
    speakers = [flow.prepare_speaker(make_voice(1, 12)), flow.prepare_speaker(make_voice(2, 7))]
    solver, encoder = PersistentSolver(flow), PersistentEncoder(flow)
    flow.use_bucketed_solver(solver, Buckets(batch=(8,), frames=(80,), prompt_frames=(64,)), encoder)
    holder, encoder_holder = SolveShape(8, 80, 64, 64, 64), EncodeShape(8, 40, 96)
    monkeypatch.setattr(Buckets, "shape", lambda self, exact: holder)
    monkeypatch.setattr(Buckets, "encode_shape", lambda self, exact, stride: encoder_holder)
    assert_streams_match(flow, speakers, plans())
    assert set(solver.runs) == {holder} and set(encoder.runs) == {encoder_holder}


def test_a_solve_of_its_first_steps_leaves_those_steps_caches_as_the_whole_solve(
    flow: DiTFlow, speakers: list[DiTSpeaker]
) -> None:
    """A graph's warm-up runs one Euler step (`steps=1`): the same kernels on the same inputs as the
    first step of the solve, so the caches that step writes are the whole solve's, to the bit."""
    solver = PersistentSolver(flow)
    flow.use_bucketed_solver(solver, Buckets(batch=(4,), frames=(20, 40, 80), prompt_frames=(64,),
                                             own_frames=(16, 32, 64), history_tokens=(16, 48, 96)))
    batched_mels(flow, speakers, plans())
    shape = solver.runs[-1]
    inputs = solver.inputs[shape]
    whole = flow.decoder.solve_ragged(inputs)
    first = flow.decoder.solve_ragged(inputs, steps=1)
    assert torch.equal(first.cnn_cache[0], whole.cnn_cache[0])
    assert torch.equal(first.kept_kv[0], whole.kept_kv[0])
    assert not torch.equal(first.mel, whole.mel)  # one step of ten is not the solution


def test_a_solve_memory_cap_splits_long_caches_only_and_keeps_results() -> None:
    """With a bytes cap that four first chunks fill, the later chunks (longer own caches) are solved in
    smaller batches, each within the cap, and every stream still equals its run alone."""
    flow = DiTFlow(CONFIGS.dit_flow).eval()
    randomize(flow, seed=0)
    speakers = [flow.prepare_speaker(make_voice(1, 12))]
    solver, encoder = PersistentSolver(flow), PersistentEncoder(flow)
    buckets = Buckets(batch=(1, 2, 4, 8), frames=(20, 40, 80), prompt_frames=(64,), own_frames=(16, 32, 64),
                      history_tokens=(16, 48, 96))
    flow.use_bucketed_solver(solver, buckets, encoder)
    first_chunks = SolveShape(4, 20, 0, 64, 16)
    memory = SolveMemory(solver.layout, 1)
    flow.limit_solve_memory(memory.bytes(first_chunks))
    generator = torch.Generator().manual_seed(3)
    streams = [Plan(0, torch.randint(0, CONFIGS.dit_flow.vocab_size, (30,), generator=generator), (8, 8, 8))
               for _ in range(4)]
    assert_streams_match(flow, speakers, streams)
    assert solver.runs[0] == first_chunks
    assert all(memory.bytes(shape) <= memory.bytes(first_chunks) for shape in solver.runs if shape.batch > 1)
    assert len(solver.runs) > 4  # four rounds of four chunks: the later ones were split
    assert {shape.own_frames for shape in solver.runs if shape.batch == 1} >= {32, 64}


def test_the_warm_up_solves_only_shapes_within_the_cap() -> None:
    """The warm-up runs the schedule through the same planning: with a cap that four first chunks fill,
    no batch of more than one row it solves (what CUDA graphs would capture) exceeds it."""
    flow = DiTFlow(CONFIGS.dit_flow).eval()
    randomize(flow, seed=0)
    solver = PersistentSolver(flow)
    flow.use_bucketed_solver(solver, Buckets(batch=(1, 2, 4)))
    budget = SolveMemory(solver.layout, 1).bytes(SolveShape(4, 30, 0, 256, 30))
    flow.limit_solve_memory(budget)
    backend = TorchToken2Wav(flow, HiFTGenerator(CONFIGS.hift).eval(), vocoder_seed=0)
    backend.warmup(backend.prepare_speaker(make_voice(1, 12)), batches=(4, 1))
    memory = SolveMemory(solver.layout, budget)
    assert SolveShape(4, 30, 0, 256, 30) in solver.runs
    assert all(memory.fits(shape) for shape in solver.runs if shape.batch > 1)
    assert any(shape.batch == 1 and shape.own_frames > 0 for shape in solver.runs)


def test_solve_graphs_cover_every_chunk_length_cached_and_short_last_chunks_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the warm-up's schedule: at the most cached state every frames bucket; at the states before
    it (after a first chunk: own bucket 32; after a second) the buckets up to the chunk met there, for
    an utterance of a few words whose last chunk comes early."""
    flow = DiTFlow(CONFIGS.dit_flow).eval()
    met = [SolveShape(64, 30, 0, 256, 30), SolveShape(64, 50, 32, 256, 82),
           SolveShape(64, 100, 100, 256, 100), SolveShape(32, 400, 200, 256, 200)]
    # What `later_graph_shapes` reads of a GraphedSolver: the shapes met (no encoder graphs here).
    monkeypatch.setattr(DiTFlow, "graphs", property(lambda self: SimpleNamespace(shapes=met)))
    later = later_graph_shapes(flow, [64, 32])
    cached = {SolveShape(b, f, 200, 256, 200) for b in (64, 32) for f in Buckets().frames}
    after_first = {SolveShape(b, f, 32, 256, min(82, 32 + f)) for b in (64, 32) for f in (30, 50)}
    after_second = {SolveShape(b, f, 100, 256, 100) for b in (64, 32) for f in (30, 50, 100)}
    assert set(later) == cached | after_first | after_second and len(later) == len(set(later))
    assert later[0] == SolveShape(64, 400, 200, 256, 200)  # the largest first


def seeded_backend(device: str, graphs: bool) -> tuple[TorchToken2Wav, list[SpeakerState]]:
    """The end-to-end tests' backend (random DiT weights, fixed vocoder noise) and its two voices."""
    torch.manual_seed(0)
    flow, hift = DiTFlow(CONFIGS.dit_flow).eval(), HiFTGenerator(CONFIGS.hift).eval()
    randomize(flow, seed=3)
    backend = TorchToken2Wav(flow.to(device), hift.to(device), vocoder_seed=5, cuda_graphs=graphs,
                             graph_hops=(4, 10))
    return backend, [backend.prepare_speaker(make_voice(1, 12)), backend.prepare_speaker(make_voice(2, 7))]


def run_plans(backend: TorchToken2Wav, voices: list[SpeakerState], streams: list[Plan]) -> list[torch.Tensor]:
    """Every plan's audio, each on a stream of its voice (`run_in_rounds`)."""
    return run_in_rounds(backend, [backend.open_stream(voices[plan.voice]) for plan in streams], streams)


def run_in_rounds(backend: TorchToken2Wav, opened: list[TorchStream],
                  streams: list[Plan]) -> list[torch.Tensor]:
    """Every plan's audio on its opened stream, its chunks in rounds through `run_chunks` (round k =
    every stream's k-th chunk)."""
    chunks = [plan.chunks() for plan in streams]
    pieces: list[list[torch.Tensor]] = [[] for _ in streams]
    for active in rounds(chunks):
        k = len(pieces[active[0]])
        jobs = [ChunkJob(opened[i], *chunks[i][k]) for i in active]
        for i, piece in zip(active, backend.run_chunks(jobs), strict=True):
            pieces[i].append(piece)
    return [torch.cat(p) for p in pieces]


def run_alone(backend: TorchToken2Wav, voices: list[SpeakerState], streams: list[Plan]
              ) -> list[list[torch.Tensor]]:
    """Every plan's audio chunks, each stream run alone (`run_chunk`)."""
    alone = []
    for plan in streams:
        stream = backend.open_stream(voices[plan.voice])
        alone.append([backend.run_chunk(ChunkJob(stream, tokens, last)) for tokens, last in plan.chunks()])
    return alone


def test_backend_run_chunks_equal_run_chunk() -> None:
    """End to end with HiFT: batched flow and batched vocoding give each stream its own audio."""
    backend, voices = seeded_backend("cpu", graphs=False)
    streams = plans()
    alone = run_alone(backend, voices, streams)
    opened = [backend.open_stream(voices[plan.voice]) for plan in streams]
    batched = run_in_rounds(backend, opened, streams)
    for plan, got, want, stream in zip(streams, batched, alone, opened, strict=True):
        assert got.numel() == SAMPLES_PER_TOKEN * plan.tokens.numel()
        torch.testing.assert_close(got, torch.cat(want), atol=ATOL, rtol=RTOL)
        assert stream.nbytes == 0  # closed after its last chunk


def test_calls_of_several_batches_on_buffers_every_call_overwrites_equal_each_stream_alone() -> None:
    """End to end, each call split into batches of two rows of one shape whose encoder and solver write
    into the same output buffers (as CUDA graphs do): the streams' caches, copied after the vocoder is
    queued, and the mels the vocoder reads are still each stream's own."""
    backend, voices = seeded_backend("cpu", graphs=False)
    streams = plans()
    alone = run_alone(backend, voices, streams)
    flow = backend.flow
    assert isinstance(flow, DiTFlow)
    solver, encoder = PersistentSolver(flow, keep_outputs=True), PersistentEncoder(flow, keep_outputs=True)
    flow.use_bucketed_solver(solver, Buckets(batch=(2,), frames=(20, 40, 80), prompt_frames=(64,),
                                             own_frames=(16, 32, 64), history_tokens=(96,)), encoder)
    batched = run_plans(backend, voices, streams)
    for plan, got, want in zip(streams, batched, alone, strict=True):
        assert got.numel() == SAMPLES_PER_TOKEN * plan.tokens.numel()
        torch.testing.assert_close(got, torch.cat(want), atol=ATOL, rtol=RTOL)
    # The first round's six first chunks: two batches of one shape in one call, and the 15-token one's
    # 40-frame solve with the last 10-token one in its padding row (`plan_batches`).
    assert solver.runs[:2] == [solver.runs[0]] * 2 and encoder.runs[:2] == [encoder.runs[0]] * 2
    assert solver.runs[2] == SolveShape(2, 40, 0, 64, 32)
    assert len(solver.outputs or {}) < len(solver.runs) and len(encoder.outputs or {}) < len(encoder.runs)


def test_batches_without_cuda_graphs_compile_nothing() -> None:
    """Only the CUDA-graph solver compiles the DiT blocks: on a CPU a batch (and a voice) runs eagerly,
    never stalling a request on Inductor."""
    from torch._dynamo.utils import counters

    flow, hift = DiTFlow(CONFIGS.dit_flow).eval(), HiFTGenerator(CONFIGS.hift).eval()
    backend = TorchToken2Wav(flow, hift)
    frames_before = counters["frames"]["total"]
    speaker = backend.prepare_speaker(make_voice(1, 12))
    streams = [backend.open_stream(speaker) for _ in range(2)]
    tokens = torch.arange(4 + PRE_LOOKAHEAD)
    backend.run_chunks([ChunkJob(stream, tokens, last=False) for stream in streams])
    assert counters["frames"]["total"] == frames_before


def test_compiled_blocks_need_one_variant_per_shape_class_whatever_the_batch() -> None:
    """Batch buckets share the compiled block: variants only for an empty or filled own cache and for
    one stream, 2–4 streams (the attention's one-call path, dit.ONE_CALL_MAX_ROWS) or more (here 2·32
    rows equal the tiny hidden size, which duck shaping would specialise)."""
    from torch._dynamo.utils import counters

    flow, hift = DiTFlow(CONFIGS.dit_flow).eval(), HiFTGenerator(CONFIGS.hift).eval()
    flow.decoder.estimator.compile_blocks(backend="aot_eager")
    backend = TorchToken2Wav(flow, hift, graph_hops=(4, 6))
    speaker = backend.prepare_speaker(make_voice(1, 12))
    graphs_before = counters["stats"]["unique_graphs"]
    backend.warmup(speaker, batches=(32, 8, 2, 1))
    assert counters["stats"]["unique_graphs"] - graphs_before <= 6


def test_warmup_runs_the_schedule_and_leaves_no_stream_open(monkeypatch: pytest.MonkeyPatch,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    """The warm-up opens one stream per row of each batch, closes them all, and logs where its time went
    (on the CPU: the chunk pass alone; no graphs, no compile workers)."""
    flow, hift = DiTFlow(CONFIGS.dit_flow).eval(), HiFTGenerator(CONFIGS.hift).eval()
    backend = TorchToken2Wav(flow, hift, graph_hops=(4, 6))
    speaker = backend.prepare_speaker(make_voice(1, 12))
    opened: list[TorchStream] = []
    open_stream = backend.open_stream

    def recording_open(voice: SpeakerState) -> TorchStream:
        opened.append(open_stream(voice))
        return opened[-1]

    monkeypatch.setattr(backend, "open_stream", recording_open)
    with caplog.at_level("INFO", logger="engines.token2wav.torch_warmup"):
        backend.warmup(speaker, batches=(1, 3))
    assert len(opened) == 4 and all(stream.nbytes == 0 for stream in opened)
    assert re.fullmatch(r"torch warm-up on cpu: chunk pass at 3 [\d.]+ s, chunk passes [\d.]+ s",
                        caplog.records[-1].getMessage())


def test_inverse_stft_equals_torch_istft() -> None:
    """HiFT's own overlap-add inverse (no host-side window check) computes what torch.istft does."""
    hift = HiFTGenerator(CONFIGS.hift)
    generator = torch.Generator().manual_seed(4)
    bins = CONFIGS.hift.istft_n_fft // 2 + 1
    spectrum = torch.complex(torch.randn(3, bins, 41, generator=generator),
                             torch.randn(3, bins, 41, generator=generator))
    n_fft, hop = CONFIGS.hift.istft_n_fft, CONFIGS.hift.istft_hop
    expected = torch.istft(spectrum, n_fft, hop, n_fft, window=hift.stft_window, center=True)
    inverse = hift.inverse_stft(spectrum.real, spectrum.imag)
    torch.testing.assert_close(inverse, expected, atol=1e-6, rtol=1e-5)


def test_source_spectrum_equals_torch_stft() -> None:
    """HiFT's source STFT (a float64 DFT matmul, no cuFFT plan per length) computes what torch.stft does,
    at lengths that are and are not multiples of the hop."""
    hift = HiFTGenerator(CONFIGS.hift)
    generator = torch.Generator().manual_seed(5)
    n_fft, hop = CONFIGS.hift.istft_n_fft, CONFIGS.hift.istft_hop
    for length in (480, 963, 4 * 480 + 1):
        source = torch.randn(3, length, generator=generator) * 0.1
        spec = torch.stft(source, n_fft, hop, n_fft, window=hift.stft_window, center=True,
                          return_complex=True)
        torch.testing.assert_close(hift.source_spectrum(source), torch.cat([spec.real, spec.imag], dim=1),
                                   atol=1e-6, rtol=1e-5)


def test_a_batch_takes_one_chunk_per_stream(flow: DiTFlow, speakers: list[DiTSpeaker]) -> None:
    stream = flow.open_stream(speakers[0])
    tokens = torch.zeros(8, dtype=torch.int64)
    with pytest.raises(ValueError, match="one chunk per stream"):
        flow.chunks([stream, stream], [tokens, tokens], [False, False])
    with pytest.raises(ValueError, match="more than 3 tokens"):
        flow.chunks([stream], [tokens[:3]], [False])


def test_a_stream_runs_its_next_chunk_only_once_its_caches_are_updated(
    flow: DiTFlow, speakers: list[DiTSpeaker]
) -> None:
    """`launch_chunks` leaves a stream's cache updates to `FlowLaunch.update_streams`: a next chunk before
    them would read stale caches, so it is refused, and after them it equals `chunks`' result."""
    plan = plans()[1]
    (first, _), (second, last) = plan.chunks()
    stream, reference = flow.open_stream(speakers[1]), flow.open_stream(speakers[1])
    launch = flow.launch_chunks([stream], [first], [False])
    with pytest.raises(RuntimeError, match="not updated its caches"):
        flow.launch_chunks([stream], [second], [last])
    launch.update_streams()
    launch.update_streams()  # once only: a second call does nothing
    flow.chunks([reference], [first], [False])
    got = flow.chunks([stream], [second], [last])[0]
    torch.testing.assert_close(got, flow.chunks([reference], [second], [last])[0], atol=0, rtol=0)


def test_a_call_whose_later_batch_fails_keeps_the_earlier_batches_caches() -> None:
    """A call split into batches whose second solve raises: the error reaches the caller, and the streams
    of the batch that ran have their caches updated (their next chunk equals a stream run without the
    failure), not left awaiting."""
    flow = DiTFlow(CONFIGS.dit_flow).eval()
    randomize(flow, seed=0)
    speaker = flow.prepare_speaker(make_voice(1, 12))
    solver = PersistentSolver(flow, keep_outputs=True)
    runs = solver.run

    def failing_second(shape: SolveShape) -> RaggedOutputs:
        if len(solver.runs) == 1:
            raise RuntimeError("solve failed")
        return runs(shape)

    flow.use_bucketed_solver(solver, Buckets(batch=(2,), frames=(20, 40, 80), prompt_frames=(64,)))
    tokens = plans()[0].tokens
    first, second = tokens[: 8 + PRE_LOOKAHEAD], tokens[8 : 13 + PRE_LOOKAHEAD]
    streams = [flow.open_stream(speaker) for _ in range(4)]
    solver.run = failing_second  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="solve failed"):
        flow.chunks(streams, [first] * 4, [False] * 4)
    solver.run = runs  # type: ignore[method-assign]
    ran = [stream for stream in streams if stream.frames]
    assert len(ran) == 2 and not any(stream.awaiting_caches for stream in streams)
    reference = flow.open_stream(speaker)
    flow.chunks([reference], [first], [False])
    want = flow.chunks([reference], [second], [False])[0]
    for stream in ran:
        torch.testing.assert_close(flow.chunks([stream], [second], [False])[0], want, atol=ATOL, rtol=RTOL)


def test_span_mask_marks_left_padded_history_and_right_padded_chunk() -> None:
    mask = span_mask(3, 2, torch.tensor([0, 2, 3]), torch.tensor([1, 2, 1]))
    assert mask.int().tolist() == [[0, 0, 0, 1, 0], [0, 1, 1, 1, 1], [1, 1, 1, 1, 0]]


def test_buckets_round_up_and_refuse_what_is_beyond() -> None:
    buckets = Buckets(batch=(1, 4), frames=(30, 50), prompt_frames=(256,), own_frames=(100, 200))
    assert buckets.shape(SolveShape(3, 31, 20, 200, 40)) == SolveShape(4, 50, 100, 256, 100)
    # A first chunk keeps at most its own frames: no larger kept buffer than own + chunk.
    assert buckets.shape(SolveShape(1, 30, 0, 256, 30)) == SolveShape(1, 30, 0, 256, 30)
    assert buckets.shape(SolveShape(1, 30, 150, 256, 170)) == SolveShape(1, 30, 200, 256, 200)
    assert buckets.shape(SolveShape(5, 30, 0, 100, 30)) is None
    assert buckets.shape(SolveShape(1, 51, 0, 100, 30)) is None
    assert buckets.shape(SolveShape(1, 30, 0, 300, 30)) is None
    assert buckets.shape(SolveShape(1, 30, 201, 256, 30)) is None
    assert buckets.shape(SolveShape(1, 30, 100, 256, 201)) is None


def test_flow_graph_buckets_follow_the_graphed_hops() -> None:
    """The service's first chunk of N tokens gets a frames bucket of its own (no padding to the default
    first chunk's 30 frames) and an own-cache bucket for the call after it; the default hops keep the
    default buckets."""
    defaults = Buckets()
    assert flow_graph_buckets(defaults, GRAPH_HOPS) == dataclasses.replace(defaults, batch=FLOW_GRAPH_BATCHES)
    ten = flow_graph_buckets(defaults, (10, 25, 50, 100))
    assert ten.frames == (20, 50, 100, 200, 400) and ten.own_frames == defaults.own_frames
    twenty = flow_graph_buckets(defaults, (20, 25, 50, 100))
    assert twenty.frames == (40, 50, 100, 200, 400) and twenty.own_frames == (48, 100, 200, 400, 800, 1600)
    assert ten.shape(SolveShape(4, 20, 0, 200, 20)) == SolveShape(4, 20, 0, 256, 20)


def test_a_second_first_hop_gets_its_buckets_vocoder_chunks_solves_and_compile_worker() -> None:
    """The light-load first chunk (`extra_first_hops`): a frames bucket of its own and the own-cache
    bucket after it (32 after 20 frames, as after 30), its first-chunk HiFT shape, its first chunks'
    solves at its frames, and a compile worker; nothing more for the hop the schedule starts with."""
    defaults = Buckets()
    both = flow_graph_buckets(defaults, GRAPH_HOPS, (10,))
    assert both.frames == (20, 30, 50, 100, 200, 400) and both.own_frames == defaults.own_frames
    assert flow_graph_buckets(defaults, GRAPH_HOPS, (15,)) == flow_graph_buckets(defaults, GRAPH_HOPS)
    assert flow_graph_buckets(defaults, (10, 25, 50, 100), (15,)) == both
    assert other_first_hops(GRAPH_HOPS, (10, 15, 10)) == (10,)
    assert vocoder_graph_chunks(CONFIGS.hift, GRAPH_HOPS, (10, 15)) == [
        *vocoder_graph_chunks(CONFIGS.hift, GRAPH_HOPS), (20, 0)]
    chunks = len(schedule_hops(GRAPH_HOPS)) + 1
    assert compile_worker_count(GRAPH_HOPS) in (chunks, 2 * chunks)
    assert compile_worker_count(GRAPH_HOPS, (10,)) in (chunks + 1, 2 * (chunks + 1))
    flow = DiTFlow(CONFIGS.dit_flow).eval()
    flow.buckets = flow_graph_buckets(flow.buckets, (5, 10), (3,))
    voice = flow.prepare_speaker(make_voice(1, 12))
    (firsts,) = first_chunk_solve_shapes(flow, [4, 1], (3,), voice.prompt_frames)
    assert {(shape.batch, shape.frames, shape.own_frames) for shape in firsts} == {(4, 6, 0), (2, 6, 0)}


def test_plan_batches_groups_by_frames_and_bounds_batch_and_prompts() -> None:
    buckets = Buckets(batch=(1, 2, 4), frames=(30, 100), prompt_frames=(300,))
    rows = [
        RowSpec(frames=30, voice=0, prompt_frames=200),
        RowSpec(frames=100, voice=0, prompt_frames=200),
        RowSpec(frames=20, voice=1, prompt_frames=200),  # a second prompt would exceed 300 frames
        RowSpec(frames=24, voice=0, prompt_frames=200),
        RowSpec(frames=30, voice=0, prompt_frames=200),
        RowSpec(frames=30, voice=0, prompt_frames=200),
        RowSpec(frames=30, voice=0, prompt_frames=200),  # fifth of its bucket: beyond 4 rows
        RowSpec(frames=500, voice=0, prompt_frames=200),  # beyond every frame bucket: alone
    ]
    assert plan_batches(rows, buckets) == [[0], [2], [3, 4, 5, 6], [1], [7]]


def test_shorter_first_chunks_fill_the_padding_rows_of_a_batch_of_longer_chunks() -> None:
    """Five 30-frame first chunks solve at the 8-row bucket: 20-frame first chunks of their voice take its
    padding rows; a first chunk of another voice (its prompt would change the padded shape), a later chunk
    (a cache: its encoder history is longer) and a first chunk of less than half the batch's frames (an
    eager solve would compute it at 30) stay apart, as do first chunks once no row is free."""
    buckets = Buckets(batch=(1, 2, 4, 8), frames=(20, 30, 50), prompt_frames=(256, 512))
    rows = [*(RowSpec(30, 0, 200) for _ in range(5)), RowSpec(20, 0, 200), RowSpec(20, 0, 200),
            RowSpec(20, 1, 200), RowSpec(20, 0, 200, own_frames=32, kept_frames=52), RowSpec(14, 0, 200)]
    assert plan_batches(rows, buckets) == [[0, 1, 2, 3, 4, 5, 6], [7, 9, 8]]
    more = [*rows[:5], *(RowSpec(20, 0, 200) for _ in range(4))]
    assert plan_batches(more, buckets) == [[0, 1, 2, 3, 4, 5, 6, 7], [8]]


def test_plan_batches_keeps_padded_solves_within_a_cap() -> None:
    """Rows go by own-cache length within a frame bucket; a batch closes when the next row would make its
    padded shape exceed the cap (here: 4 rows without a cache, 2 with up to 100 frames), and a lone row
    runs whatever it needs."""
    buckets = Buckets(batch=(1, 2, 4), frames=(30,), prompt_frames=(300,), own_frames=(100, 400))

    def fits(shape: SolveShape) -> bool:  # a stand-in for SolveMemory.fits: bytes grow with rows × cache
        return shape.batch * (shape.own_frames + 50) <= 300

    rows = [RowSpec(30, 0, 200, own_frames=own, kept_frames=own) for own in (400, 0, 80, 0, 90, 0, 0, 0, 60)]
    assert plan_batches(rows, buckets, fits) == [[1, 3, 5, 6], [7, 8], [2, 4], [0]]
    assert plan_batches(rows, buckets) == [[1, 3, 5, 6], [7, 8, 2, 4], [0]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_equal_the_eager_solve() -> None:
    """Graph replays of Inductor-compiled blocks (fp32, TF32 matmuls) equal eager batched runs on the same
    device, with caches trimmed (kept-frame gathers inside the graphs)."""
    device = torch.device("cuda")
    streams = plans()
    results = []
    for graphs in (False, True):
        flow = DiTFlow(TRIMMING).eval()
        randomize(flow, seed=0)
        flow.to(device)
        if graphs:
            flow.enable_cuda_graphs(Buckets(batch=(4, 8), frames=(20, 40, 80), prompt_frames=(64,),
                                            own_frames=(16, 32, 64)))
        voices = [flow.prepare_speaker(make_voice(1, 12)), flow.prepare_speaker(make_voice(2, 7))]
        results.append(batched_mels(flow, voices, streams))
        if graphs:
            assert flow.graphs is not None and flow.graphs.shapes
    for eager, graphed in zip(*results, strict=True):
        for e, g in zip(eager, graphed, strict=True):
            torch.testing.assert_close(g, e, atol=TF32_ATOL, rtol=TF32_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_graphs_captured_before_a_buffer_grew_are_captured_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes met in increasing size grow the arena's buffers; the graphs on the replaced buffers are
    captured again on the grown ones (here whatever their size), which frees the old ones, and every
    graph still computes what the eager solve does."""
    import engines.token2wav.graphs as graphs_module

    device = torch.device("cuda")
    streams = plans()
    results, held = [], []
    for min_bytes in (None, 2**62, 0):
        if min_bytes is not None:
            monkeypatch.setattr(graphs_module, "RECAPTURE_MIN_BYTES", min_bytes)
        flow = DiTFlow(TRIMMING).eval()
        randomize(flow, seed=0)
        flow.to(device)
        if min_bytes is not None:
            flow.enable_cuda_graphs(Buckets(batch=(4, 8), frames=(20, 40, 80), prompt_frames=(64,),
                                            own_frames=(16, 32, 64)))
        voices = [flow.prepare_speaker(make_voice(1, 12)), flow.prepare_speaker(make_voice(2, 7))]
        results.append(batched_mels(flow, voices, streams))
        if flow.graphs is not None:
            held.append(flow.graphs.static_bytes)
    assert held[0] > held[1]  # the same shapes; captured again, the old buffers are gone
    for graphed in results[1:]:
        for eager, mels in zip(results[0], graphed, strict=True):
            for e, g in zip(eager, mels, strict=True):
                torch.testing.assert_close(g, e, atol=TF32_ATOL, rtol=TF32_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_backend_with_cuda_graphs_equals_eager() -> None:
    """End to end on CUDA: solver and HiFT graphs (fp32) give the audio of the eager batched path."""
    audio = []
    for graphs in (False, True):
        backend, voices = seeded_backend("cuda", graphs)
        audio.append(run_plans(backend, voices, plans()))
        if graphs:
            assert backend.vocoder_graphs is not None
            assert any(shape.padded for shape in backend.vocoder_graphs.shapes)  # final chunks, masked
    for eager, graphed in zip(*audio, strict=True):
        torch.testing.assert_close(graphed, eager, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_shorter_first_chunk_runs_from_graphs_of_its_own_length_and_equals_eager() -> None:
    """`--first-chunk-tokens`: with graph hops (5, 10) and the buckets that follow them, 5-token first
    chunks are solved at their own 10 frames (not padded to 30) and vocoded from their graph, and the
    audio is the eager path's."""
    generator = torch.Generator().manual_seed(11)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, CONFIGS.dit_flow.vocab_size, (n,), generator=generator)

    streams = [Plan(0, tokens(23), (5, 10)), Plan(1, tokens(23), (5, 10)), Plan(0, tokens(12), (5,))]
    audio = []
    for graphs in (False, True):
        torch.manual_seed(0)
        flow, hift = DiTFlow(CONFIGS.dit_flow).eval(), HiFTGenerator(CONFIGS.hift).eval()
        randomize(flow, seed=3)
        hops = (5, 10)
        backend = TorchToken2Wav(flow.cuda(), hift.cuda(), vocoder_seed=5, cuda_graphs=graphs,
                                 graph_hops=hops, flow_buckets=flow_graph_buckets(flow.buckets, hops))
        voices: list[SpeakerState] = [backend.prepare_speaker(make_voice(1, 12)),
                                      backend.prepare_speaker(make_voice(2, 7))]
        audio.append(run_plans(backend, voices, streams))
        if graphs:
            solver = flow.graphs
            assert solver is not None and backend.vocoder_graphs is not None
            assert any(shape.frames == 10 and shape.own_frames == 0 for shape in solver.shapes)
            assert any(shape.frames == 10 and shape.cached == 0 for shape in backend.vocoder_graphs.shapes)
    for eager, graphed in zip(*audio, strict=True):
        torch.testing.assert_close(graphed, eager, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_light_load_first_chunks_replay_graphs_the_warm_up_captured_and_equal_eager() -> None:
    """`extra_first_hops`: the warm-up's first stage captures the solve and HiFT graphs of 4-token first
    chunks at every batch beside the schedule's 5-token ones; streams starting with either (in one call,
    a 4-token one in the padding row of a 5-token one's solve) replay them, no capture after the warm-up,
    and give the eager path's audio."""
    generator = torch.Generator().manual_seed(13)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(0, CONFIGS.dit_flow.vocab_size, (n,), generator=generator)

    streams = [Plan(0, tokens(23), (4, 10)), Plan(0, tokens(23), (5, 10)), Plan(0, tokens(9), (4,))]
    hops, light = (5, 10), (4,)
    audio = []
    for graphs in (False, True):
        torch.manual_seed(0)
        flow, hift = DiTFlow(CONFIGS.dit_flow).eval(), HiFTGenerator(CONFIGS.hift).eval()
        randomize(flow, seed=3)
        backend = TorchToken2Wav(flow.cuda(), hift.cuda(), vocoder_seed=5, cuda_graphs=graphs,
                                 graph_hops=hops, flow_buckets=flow_graph_buckets(flow.buckets, hops, light),
                                 extra_first_hops=light)
        voice = backend.prepare_speaker(make_voice(1, 12))
        if graphs:
            backend.warmup(voice, batches=(4, 2, 1))
            solver, vocoder = flow.graphs, backend.vocoder_graphs
            assert solver is not None and vocoder is not None
            solves, vocodes = set(solver.shapes), set(vocoder.shapes)
            assert {shape.batch for shape in solves if (shape.frames, shape.own_frames) == (8, 0)} == {2, 4}
            assert {shape.batch for shape in vocodes if (shape.frames, shape.cached) == (8, 0)} == {1, 2, 4}
        audio.append(run_plans(backend, [voice], streams))
        if graphs:
            assert set(solver.shapes) == solves and set(vocoder.shapes) == vocodes
    for eager, graphed in zip(*audio, strict=True):
        torch.testing.assert_close(graphed, eager, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_up_captures_the_final_chunk_graphs(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After the warm-up, final chunks of lengths it never ran (every plan's) come from its padded HiFT
    graphs, no new capture, and each stream's audio is what the eager backend gives it. The warm-up
    sizes the graphs' shared buffers first: no graph is captured twice, even where any grown buffer,
    however small, would be captured again."""
    import engines.token2wav.graphs as graphs_module

    monkeypatch.setattr(graphs_module, "RECAPTURE_MIN_BYTES", 0)
    eager_backend, eager_voices = seeded_backend("cuda", graphs=False)
    eager = run_plans(eager_backend, eager_voices, plans())
    backend, voices = seeded_backend("cuda", graphs=True)
    with caplog.at_level(logging.INFO, logger="engines.token2wav.graphs"):
        backend.warmup(voices[0], batches=(4, 2, 1))
    assert not [r.getMessage() for r in caplog.records if "captured again" in r.getMessage()]
    vocoder = backend.vocoder_graphs
    assert vocoder is not None
    captured = set(vocoder.shapes)
    assert {s.frames for s in captured if s.padded and s.cached} == set(vocoder.finals.frames)
    # The solve graphs of every frames bucket at the most cached state the warm-up reached.
    flow = backend.flow
    assert isinstance(flow, DiTFlow) and flow.graphs is not None
    top = max(shape.own_frames for shape in flow.graphs.shapes)
    assert {s.frames for s in flow.graphs.shapes if s.own_frames == top} == set(flow.buckets.frames)
    graphed = run_plans(backend, voices, plans())
    assert set(vocoder.shapes) == captured
    for e, g in zip(eager, graphed, strict=True):
        torch.testing.assert_close(g, e, atol=ATOL, rtol=RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_staged_warm_up_serves_between_its_steps_and_ends_with_every_graph(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first stage captures every chunk of the largest batch and a first chunk at every other batch
    size; calls between steps capture nothing (shapes not captured yet replay a larger graph holding them,
    quietly) and give the audio the graphs give later; the steps then capture what a warm-up in one go
    does, and seal."""
    backend, voices = seeded_backend("cuda", graphs=True)
    whole, whole_voices = seeded_backend("cuda", graphs=True)
    whole.warmup(whole_voices[0], batches=(4, 2, 1))
    flow, vocoder = backend.flow, backend.vocoder_graphs
    assert isinstance(flow, DiTFlow) and flow.graphs is not None and vocoder is not None
    steps = backend.staged_warmup(voices[0], batches=(4, 2, 1))
    next(steps)
    first_stage = set(flow.graphs.shapes)
    assert {s.batch for s in first_stage if s.own_frames == 0} == {4, 2}  # flow graphs from 2 rows up
    assert {s.batch for s in first_stage if s.own_frames > 0} == {4}
    assert {s.batch for s in vocoder.shapes if not s.cached} == {4, 2, 1}
    graphs = [flow.graphs, *flow.graph_sets()[1:], vocoder]
    counts = [len(g.shapes) for g in graphs]
    stood_in: dict[str, list[bool]] = {}
    for g in graphs:
        def spy(shape: Any, own: Any = g.stand_in, kind: str = type(g).__name__) -> Any:
            ran_at = own(shape)
            stood_in.setdefault(kind, []).append(ran_at != shape)
            return ran_at
        monkeypatch.setattr(g, "stand_in", spy)
    with caplog.at_level(logging.WARNING, logger="engines.token2wav.graphs"):
        between = run_plans(backend, voices, plans())
    assert [len(g.shapes) for g in graphs] == counts
    assert any(stood_in["GraphedSolver"]) and any(stood_in["GraphedEncoder"])  # HiFT: where shapes allow
    assert not [r for r in caplog.records if "has no CUDA graph" in r.getMessage()]
    taken = sum(1 for _ in steps)
    assert taken > 0
    assert not flow.graphs.covers(SolveShape(4, 30, 0, 4096, 30))  # sealed: nothing more is captured
    for mine, theirs in zip(graphs, [whole.flow.graphs, *whole.flow.graph_sets()[1:], whole.vocoder_graphs],
                            strict=True):
        assert theirs is not None and set(mine.shapes) == set(theirs.shapes)
    after = run_plans(backend, voices, plans())
    for b, a in zip(between, after, strict=True):  # other shapes, other TF32 kernels
        torch.testing.assert_close(b, a, atol=TF32_ATOL, rtol=TF32_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_without_final_chunk_graphs_the_warm_up_captures_none() -> None:
    flow, hift = DiTFlow(CONFIGS.dit_flow).eval(), HiFTGenerator(CONFIGS.hift).eval()
    backend = TorchToken2Wav(flow.cuda(), hift.cuda(), graph_hops=(4, 10), final_chunk_graphs=False)
    backend.warmup(backend.prepare_speaker(make_voice(1, 12)), batches=(2, 1))
    assert backend.vocoder_graphs is not None and backend.vocoder_graphs.shapes
    assert not any(shape.padded for shape in backend.vocoder_graphs.shapes)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_launching_chunks_never_waits_for_the_device() -> None:
    """`launch_chunks` queues a call without one host-device synchronisation (CUDA's sync debug mode
    raises on any), from graphs (the last chunks padded to theirs, the rows' lengths uploaded) and
    eagerly, and its audio, waited for afterwards, is what `run_chunks` gave the same streams."""
    streams = plans()
    chunks = [plan.chunks() for plan in streams]
    backend, voices = seeded_backend("cuda", graphs=True)
    audio = []
    for launched in (False, True):  # the first pass captures the graphs (a capture synchronises)
        opened = [backend.open_stream(voices[plan.voice]) for plan in streams]
        pieces: list[list[torch.Tensor]] = [[] for _ in streams]
        for active in rounds(chunks):
            k = len(pieces[active[0]])
            jobs = [ChunkJob(opened[i], *chunks[i][k]) for i in active]
            if launched:
                with warnings.catch_warnings():  # "a prototype feature": the project's pytest errors on it
                    warnings.simplefilter("ignore", UserWarning)
                    torch.cuda.set_sync_debug_mode("error")
                try:
                    call = backend.launch_chunks(jobs)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                results = call.wait()
            else:
                results = backend.run_chunks(jobs)
            for i, piece in zip(active, results, strict=True):
                pieces[i].append(piece)
        audio.append([torch.cat(p) for p in pieces])
    for ran, launched_audio in zip(*audio, strict=True):
        torch.testing.assert_close(launched_audio, ran, atol=ATOL, rtol=RTOL)


def test_compiled_blocks_equal_eager(flow: DiTFlow, speakers: list[DiTSpeaker]) -> None:
    """DiT blocks through torch.compile give the eager blocks' mels: the tracing (dataclass keys, dynamic
    shapes, first and later chunks) with AOT autograd's graphs run eagerly, because Inductor's C++ build
    takes minutes on a CPU; Inductor itself is checked on CUDA (graphs == eager above)."""
    compiled = DiTFlow(CONFIGS.dit_flow).eval().requires_grad_(False)
    randomize(compiled, seed=0)  # the weights of `flow`, whose speakers it reuses
    compiled.decoder.estimator.compile_blocks(backend="aot_eager")
    streams = plans()
    with torch.inference_mode():  # as the engines run
        want, got = batched_mels(flow, speakers, streams), batched_mels(compiled, speakers, streams)
    for wanted, gotten in zip(want, got, strict=True):
        for w, g in zip(wanted, gotten, strict=True):
            torch.testing.assert_close(g, w, atol=ATOL, rtol=RTOL)


def test_reserved_graph_buffers_are_inference_tensors() -> None:
    """Buffers reserved outside inference mode (the warm-up's `reserve_graphs`) are of the kind the
    captures inside the chunk calls allocate: inference tensors. Views of ordinary ones reach the compiled
    DiT block as ordinary tensors, and its variants compiled on inference tensors no longer serve."""
    import engines.token2wav.graphs as graphs_module

    class Buffers(graphs_module.ShapeGraphs[int, None, None]):
        def __init__(self) -> None:  # the arena and graph table alone: no CUDA here
            self._arena = graphs_module._Arena(torch.device("cpu"))
            self._graphs = {}
            self._capturing, self._sealed = True, False

        def _static_buffers(self, shape: int, view: graphs_module.TensorSource) -> None:
            view("in.x", (shape, 2), torch.float16)

    buffers = Buffers()
    buffers.reserve([3, 5])
    with torch.inference_mode():
        x = buffers._arena.view("in.x", (4, 2), torch.float16)
    assert x.is_inference()
    assert buffers._arena.reserve("in.x", 10, torch.float16).numel() == 10  # the most any shape views
    buffers.seal()
    buffers.reserve([9])  # sealed: nothing more is captured, so nothing grows
    assert buffers._arena.reserve("in.x", 10, torch.float16).numel() == 10


def test_paused_graphs_capture_only_inside_a_step_and_sealed_ones_never(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The graph states of a staged warm-up (graphs.py): open, a shape's graph is captured at its first use;
    paused, only inside `capturing` (a step), and a shape without a graph runs eagerly without a word (its
    step may come); sealed, never again, even when sealed inside a step, and such a shape is logged once."""
    import engines.token2wav.graphs as graphs_module

    class States(graphs_module.ShapeGraphs[int, None, None]):
        def __init__(self) -> None:  # the state alone: no CUDA here
            self._graphs, self._uncaptured = {}, set()
            self._capturing, self._sealed = True, False

    graphs = States()
    assert graphs.covers(3)
    graphs.pause()
    with caplog.at_level(logging.WARNING, logger="engines.token2wav.graphs"):
        assert not graphs.covers(3)
        assert not caplog.records
        with graphs.capturing():
            assert graphs.covers(3)
        assert not graphs.covers(3)
        with graphs.capturing():
            graphs.seal()
        assert not graphs.covers(3) and not graphs.covers(3)
        with graphs.capturing():
            assert not graphs.covers(3)  # sealed graphs capture nothing, even inside a step
    assert sum("has no CUDA graph" in record.getMessage() for record in caplog.records) == 1
    opened = States()  # sealed inside a step while still open (before any pause): sealed after it
    with opened.capturing():
        opened.seal()
    assert not opened.covers(3)


def test_a_shape_without_a_graph_runs_in_the_least_padded_captured_graph_holding_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`ShapeGraphs.stand_in`: a captured shape, or any shape while captures are open, runs at itself; else
    the cheapest captured shape (by attention work, not rows alone) that holds it in every dimension (HiFT:
    in rows alone, never for padded final chunks); none: itself (eagerly). Sealed, each is logged once."""
    import engines.token2wav.graphs as graphs_module
    from engines.token2wav.vocoder_graphs import GraphedVocoder, VocodeShape

    def states(kind: type, captured: list[object]) -> Any:
        graphs = object.__new__(kind)  # the graph table and states alone: no CUDA here
        graphs._graphs, graphs._uncaptured = dict.fromkeys(captured), set()
        graphs._capturing, graphs._sealed = True, False
        return graphs

    small, large = SolveShape(16, 50, 100, 64, 100), SolveShape(64, 50, 100, 64, 100)
    wide, tall = SolveShape(16, 100, 200, 64, 200), SolveShape(8, 50, 1600, 4096, 200)
    solver = states(graphs_module.GraphedSolver, [large, wide, tall, small])
    later = SolveShape(8, 50, 100, 64, 60)
    assert solver.stand_in(later) == later  # open: its graph is captured now
    solver.pause()
    assert solver.stand_in(later) == small  # least attention work (`tall` has fewer rows)
    assert solver.stand_in(SolveShape(16, 100, 100, 64, 100)) == wide  # the only one holding its frames
    assert solver.stand_in(SolveShape(32, 50, 0, 64, 30)) == large  # a first chunk: no own cache
    assert solver.stand_in(small) == small
    beyond = SolveShape(128, 50, 100, 64, 100)
    assert solver.stand_in(beyond) == beyond  # nothing holds it: eagerly
    with solver.capturing():
        assert solver.stand_in(later) == later
    encoder = states(graphs_module.GraphedEncoder, [EncodeShape(64, 25, 128), EncodeShape(16, 50, 64)])
    encoder.pause()
    assert encoder.stand_in(EncodeShape(8, 25, 64)) == EncodeShape(16, 50, 64)
    assert encoder.stand_in(EncodeShape(8, 25, 100)) == EncodeShape(64, 25, 128)
    chunk, final = VocodeShape(64, 58, 3840), VocodeShape(64, 64, 3840, padded=True)
    vocoder = states(GraphedVocoder, [chunk, final])
    vocoder.pause()
    assert vocoder.stand_in(VocodeShape(16, 58, 3840)) == chunk
    assert vocoder.stand_in(VocodeShape(16, 50, 3840)) == VocodeShape(16, 50, 3840)  # frames are the audio's
    assert vocoder.stand_in(VocodeShape(8, 64, 3840, padded=True)) == VocodeShape(8, 64, 3840, padded=True)
    solver.seal()
    with caplog.at_level(logging.WARNING, logger="engines.token2wav.graphs"):
        assert solver.stand_in(later) == small and solver.stand_in(later) == small
        assert solver.stand_in(beyond) == beyond and not solver.covers(beyond)
    messages = [record.getMessage() for record in caplog.records]
    assert sum("runs in" in message for message in messages) == 1
    assert sum("runs eagerly" in message for message in messages) == 1


def test_a_staged_warm_up_captures_a_pass_s_graphs_before_the_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before another batch size's chunk pass, the staged warm-up captures, one per step, the solves the
    pass plans (at the batch's bucket), the later solve and encoder graphs there, and the HiFT shapes of
    the pass's chunks that graphs serve (its first chunk without HiFT's cache, the later ones after it),
    each once: the pass's own calls then replay them (engines/token2wav/torch_warmup.py)."""
    import engines.token2wav.torch_warmup as torch_warmup
    from engines.config import TOKEN_MEL_RATIO
    from engines.token2wav.torch_backend import schedule_hops, vocoder_graph_chunks
    from engines.token2wav.vocoder_graphs import FINAL_CHUNK_FRAMES, FinalChunkBuckets, VocodeShape

    flow = DiTFlow(CONFIGS.dit_flow).eval()
    voice = flow.prepare_speaker(make_voice(1, 12))
    later = EncodeShape(4, 5, 128)
    captured: list[object] = []

    def capture_flow_graph(self: DiTFlow, shape: object) -> bool:
        if shape in captured:
            return False
        captured.append(shape)
        return True

    monkeypatch.setattr(torch_warmup, "later_graph_shapes", lambda flow, batches: [later])
    monkeypatch.setattr(DiTFlow, "capture_graph", capture_flow_graph)
    hift, graph_hops = CONFIGS.hift, (4, 10)
    vocoded: list[VocodeShape] = []

    def capture_vocoder_graph(shape: VocodeShape) -> bool:
        if shape in vocoded:
            return False
        vocoded.append(shape)
        return True

    chunks = frozenset(vocoder_graph_chunks(hift, graph_hops))
    finals = FinalChunkBuckets(FINAL_CHUNK_FRAMES, (1, 2, 4, 8), 8 * 400)
    vocoder = SimpleNamespace(hift=SimpleNamespace(cfg=hift), batches=(1, 2, 4, 8), chunks=chunks,
                              finals=finals, final_bucket=lambda frames, cached: None
                              if (frames, cached) in chunks else finals.bucket(frames),
                              capture_missing=capture_vocoder_graph)
    t2w = SimpleNamespace(flow=flow, vocoder_graphs=vocoder)
    hops = schedule_hops(graph_hops)
    steps = sum(1 for _ in torch_warmup._graphs_of_pass(t2w, voice, 3, hops))  # type: ignore[arg-type]
    per_chunk = planned_solve_shapes(flow, [3], hops, voice.prompt_frames)
    planned = list(dict.fromkeys(shape for shapes in per_chunk for shape in shapes
                                 if flow.buckets.shape(shape) == shape))
    assert planned and all(shape.batch == 4 for shape in planned)
    assert captured == [*planned, later]
    # The pass's later chunk after HiFT's cache (its first chunk's shape is the first stage's), then its
    # last chunk, the lookahead alone after the cache, padded to a final-chunk bucket in row buckets.
    cache = hift.source_cache_samples
    last = TOKEN_MEL_RATIO * PRE_LOOKAHEAD + hift.mel_cache_frames
    assert vocoded == [VocodeShape(4, TOKEN_MEL_RATIO * 10 + hift.mel_cache_frames, cache, padded=False),
                       VocodeShape(2, 16, cache, padded=True), VocodeShape(1, 16, cache, padded=True)]
    assert last <= 16 and vocoder.final_bucket(last, cache) == 16
    assert steps == len(captured) + len(vocoded)


def test_a_failed_vocoder_launch_still_leaves_the_streams_flow_caches_updated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The flow's cache updates run even when the vocoder's launch raises: the error reaches the caller,
    and the streams are not left refusing their next chunk."""
    import engines.token2wav.torch_backend as backend_module

    backend, voices = seeded_backend("cpu", graphs=False)
    stream = backend.open_stream(voices[0])
    (first, _), (second, _), *_ = plans()[0].chunks()

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("vocoder failed")

    with monkeypatch.context() as patch:
        patch.setattr(backend_module, "launch_vocode_streams", failing)
        with pytest.raises(RuntimeError, match="vocoder failed"):
            backend.run_chunks([ChunkJob(stream, first, False)])
    assert isinstance(stream.flow, DiTStream) and not stream.flow.awaiting_caches
    assert stream.flow.frames == 2 * 8  # the first chunk's 8 tokens went through the flow
