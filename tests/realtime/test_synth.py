"""`realtime synth` on the tiny models: a JSON Lines file of texts becomes decodable files of the
expected lengths (fixed-length requests), and the single-text form still writes one WAV."""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import av
import numpy as np
import pytest

from engines.config import SAMPLE_RATE, SAMPLES_PER_TOKEN
from engines.cuda_memory import ALLOCATOR_ENV, EXPANDABLE_SEGMENTS, OPERATOR_ENVS
from engines.llm.base import LLMRequest, PromptMode, SamplingParams, TokenStream
from engines.llm.torch_engine import TorchLLMEngine
from engines.token2wav.base import ChunkJob, LaunchedChunks
from engines.token2wav.torch_backend import TorchToken2Wav
from realtime.cli import main
from realtime.config import ServiceConfig
from realtime.runtime import Runtime
from realtime.synth import SynthItem, read_jsonl, run

TOKENS = 40


def decode(path: Path) -> tuple[np.ndarray, int]:
    """Mono samples and rate of an audio file."""
    with av.open(str(path)) as container:
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    return np.concatenate(frames), rate


@pytest.fixture(autouse=True)
def allocator_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """`main` configures the CUDA allocator through the environment; undone after each test."""
    for name in OPERATOR_ENVS:
        monkeypatch.delenv(name, raising=False)


def cli(models: Path, *args: str) -> list[str]:
    common = ["--models", str(models), "--device", "cpu", "--fixed-length", str(TOKENS), "--seed", "7"]
    return ["synth", *common, *args]


# Chunks (tokens, last) of one utterance of TOKENS tokens: by default the exponential schedule's (a hop
# of 15 with the 3 lookahead tokens handed again, then the rest, fewer than the next hop of 25), whose
# shapes the warm-up captures, whatever --schedule the sessions use; with --render-hop, hops of that
# size; all at once when it is longer than the utterance.
@pytest.mark.parametrize(("hop_args", "chunks"), [
    ((), [(18, False), (25, True)]),
    (("--schedule", "equal"), [(18, False), (25, True)]),
    (("--render-hop", "15"), [(18, False), (18, False), (10, True)]),
    (("--render-hop", "100"), [(TOKENS, True)]),
])
def test_jsonl_items_become_files_of_the_expected_length(
    tiny_models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    hop_args: tuple[str, ...], chunks: list[tuple[int, bool]],
) -> None:
    batches: list[list[tuple[int, bool]]] = []
    launch_chunks = TorchToken2Wav.launch_chunks

    def recording(self: TorchToken2Wav, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        batches.append([(job.tokens.numel(), job.last) for job in jobs])
        return launch_chunks(self, jobs)

    monkeypatch.setattr(TorchToken2Wav, "launch_chunks", recording)
    modes: list[PromptMode] = []
    submit = TorchLLMEngine.submit

    def recording_submit(self: TorchLLMEngine, request: LLMRequest) -> TokenStream:
        modes.append(request.mode)
        return submit(self, request)

    monkeypatch.setattr(TorchLLMEngine, "submit", recording_submit)
    items = [
        {"text": "Hello there.", "out": "a.wav"},
        {"text": "A second, longer sentence to speak.", "voice": "default", "out": "out/b.flac",
         "instructions": "Speak slowly."},
        {"text": "Third.", "out": str(tmp_path / "c.mp3"), "language": "zh"},
    ]
    jsonl = tmp_path / "items.jsonl"
    jsonl.write_text("\n".join(json.dumps(item) for item in items) + "\n\n")
    assert main(cli(tiny_models, "--jsonl", str(jsonl), "--batch", "2", *hop_args)) == 0
    # Each utterance's chunks follow the render hop; a call takes at most --batch of them.
    assert sorted(job for batch in batches for job in batch) == sorted(chunks * 3)
    assert sorted(modes) == sorted(PromptMode)
    assert max(len(batch) for batch in batches) <= 2

    expected = TOKENS * SAMPLES_PER_TOKEN
    for name in ("a.wav", "out/b.flac"):
        samples, rate = decode(tmp_path / name)
        assert rate == SAMPLE_RATE and samples.size == expected
        assert np.abs(samples).max() > 0
    samples, rate = decode(tmp_path / "c.mp3")
    # MP3 frames hold 1152 samples; the encoder pads the start and the last frame.
    assert rate == SAMPLE_RATE and expected <= samples.size <= expected + 3 * 1152
    header, row, work = capsys.readouterr().out.strip().splitlines()[-3:]
    assert header.split() == ["items", "audio", "s", "wall", "s", "RTF"]
    count, audio_s, _, _ = row.split()
    assert int(count) == 3 and float(audio_s) == pytest.approx(3 * expected / SAMPLE_RATE)
    # The engines' work in the run: the LLM decoded the 3 × TOKENS tokens (at least TOKENS steps); the
    # token2wav calls carried the chunks recorded above.
    steps = int(re.search(r"LLM: (\d+) steps", work)[1])  # type: ignore[index]
    calls, per_call = re.search(r"token2wav: (\d+) calls of ([\d.]+) chunks", work).groups()  # type: ignore[union-attr]
    assert steps >= TOKENS and int(calls) == len(batches)
    assert float(per_call) == pytest.approx(sum(map(len, batches)) / len(batches), abs=0.05)


def test_single_text_writes_one_wav(tiny_models: Path, tmp_path: Path) -> None:
    out = tmp_path / "speech.wav"
    assert main(cli(tiny_models, "Just one text.", "--out", str(out))) == 0
    assert os.environ[ALLOCATOR_ENV] == EXPANDABLE_SEGMENTS  # set before the engines started
    samples, rate = decode(out)
    assert rate == SAMPLE_RATE and samples.size == TOKENS * SAMPLES_PER_TOKEN


def test_bad_items_are_refused_before_synthesis(tmp_path: Path) -> None:
    jsonl = tmp_path / "items.jsonl"
    jsonl.write_text('{"text": "fine", "out": "a.wav"}\n{"text": "no output"}\n')
    with pytest.raises(ValueError, match="items.jsonl:2"):
        read_jsonl(jsonl)
    with pytest.raises(ValueError, match="extension"):
        SynthItem("text", tmp_path / "a.aiff")


def test_a_progress_bar_counts_the_items_written(
    tiny_models: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With `progress` (the CLI's when standard error is a terminal) a bar on standard error counts the
    items as their files are written; without it, nothing is written there."""
    config = ServiceConfig(models_dir=tiny_models, voices_dir=tmp_path / "voices", device="cpu")
    items = [SynthItem(text, tmp_path / f"{i}.wav") for i, text in enumerate(("One.", "Two."))]
    sampling = SamplingParams(seed=3, fixed_length=TOKENS)
    report = run(config, items, sampling, progress=True)
    assert report.items == 2 and all(item.out.exists() for item in items)
    assert "synth: 100%" in capsys.readouterr().err.replace("\r", "\n")
    run(config, items[:1], sampling)
    assert "synth" not in capsys.readouterr().err


async def test_a_cancelled_render_frees_its_llm_request_and_token2wav_stream(
    tiny_models: Path, tmp_path: Path, eventually: Callable[[Callable[[], bool]], Awaitable[None]],
) -> None:
    """A render cancelled while its chunks are synthesised (a synth run stopped) releases what it held:
    its LLM request and its token2wav stream; the runtime then renders the next text in full."""
    runtime = Runtime(ServiceConfig(models_dir=tiny_models, voices_dir=tmp_path, device="cpu"))
    await runtime.start()
    try:
        sampling = SamplingParams(seed=1, fixed_length=400)
        render = asyncio.create_task(runtime.render("A long text to stop halfway.", "default", sampling))
        await eventually(lambda: runtime.stats().token2wav_streams == 1)  # decoding, chunks under way
        render.cancel()
        with pytest.raises(asyncio.CancelledError):
            await render
        await eventually(lambda: runtime.stats().token2wav_streams == 0 and runtime.stats().llm_active == 0)
        pcm = await runtime.render("Short.", "default", SamplingParams(seed=2, fixed_length=TOKENS))
        assert pcm.size == TOKENS * SAMPLES_PER_TOKEN
    finally:
        await runtime.stop(1.0)
