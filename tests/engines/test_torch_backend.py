"""TorchToken2Wav over the tiny DiT flow and HiFT: chunk sizes, streaming vs offline audio, loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engines.config import MANIFEST_NAME, SAMPLES_PER_TOKEN, ModelConfigs, ModelPaths
from engines.token2wav.base import ChunkJob
from engines.token2wav.flow_dit import DiTFlow
from engines.token2wav.flow_unet import UNetFlow
from engines.token2wav.hift import HiFTGenerator
from engines.token2wav.torch_backend import TorchSpeaker, TorchToken2Wav
from engines.voice import VoicePrompt

CONFIGS = ModelConfigs.tiny()
LOOKAHEAD = CONFIGS.dit_flow.encoder.pre_lookahead
HOLD_BACK = CONFIGS.hift.source_cache_samples
PROMPT_TOKENS = 10
SEED = 11


@pytest.fixture(scope="module")
def backend() -> TorchToken2Wav:
    torch.manual_seed(0)
    return TorchToken2Wav(DiTFlow(CONFIGS.dit_flow), HiFTGenerator(CONFIGS.hift), vocoder_seed=SEED)


@pytest.fixture(scope="module")
def voice() -> VoicePrompt:
    generator = torch.Generator().manual_seed(2)
    return VoicePrompt(
        prompt_text="prompt",
        speech_tokens=torch.randint(0, 6561, (PROMPT_TOKENS,), generator=generator),
        speaker_embedding=torch.randn(192, generator=generator),
        prompt_mel=torch.randn(2 * PROMPT_TOKENS, 80, generator=generator),
    )


@pytest.fixture(scope="module")
def tokens(voice: VoicePrompt) -> torch.Tensor:
    """Starts like the prompt, so the prompt's stand-in lookahead is the real one (see test_dit_flow)."""
    rest = torch.randint(0, 6561, (25,), generator=torch.Generator().manual_seed(3))
    return torch.cat([voice.speech_tokens[:LOOKAHEAD], rest])


def stream_audio(backend: TorchToken2Wav, speaker: TorchSpeaker, tokens: torch.Tensor,
                 hops: list[int]) -> list[torch.Tensor]:
    stream = backend.open_stream(speaker)
    pieces, start = [], 0
    for hop in hops:
        pieces.append(backend.run_chunk(ChunkJob(stream, tokens[start:start + hop + LOOKAHEAD], last=False)))
        start += hop
    pieces.append(backend.run_chunk(ChunkJob(stream, tokens[start:], last=True)))
    assert stream.nbytes == 0  # freed by the last chunk
    return pieces


def test_chunk_sizes_and_range(backend: TorchToken2Wav, voice: VoicePrompt, tokens: torch.Tensor) -> None:
    hops = [10, 8]
    pieces = stream_audio(backend, backend.prepare_speaker(voice), tokens, hops)
    rest = tokens.numel() - sum(hops)
    assert [p.numel() for p in pieces] == [
        SAMPLES_PER_TOKEN * 10 - HOLD_BACK, SAMPLES_PER_TOKEN * 8, SAMPLES_PER_TOKEN * rest + HOLD_BACK]
    audio = torch.cat(pieces)
    assert audio.dtype == torch.float32 and audio.device.type == "cpu"
    assert audio.numel() == SAMPLES_PER_TOKEN * tokens.numel()
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1.0


def test_streaming_audio_matches_offline(backend: TorchToken2Wav, voice: VoicePrompt,
                                         tokens: torch.Tensor) -> None:
    """Streamed audio against HiFT run once over the block-causal offline mel, same noise seed.

    The flow's streaming mel equals its block-causal offline mel to ~1e-6 (test_dit_flow), so what is
    left is HiFT's streaming: equal away from the joins; within 3840 samples of a join the held-back
    tail was re-synthesised with only 8 frames of left context and cross-faded under a Hamming window,
    so there we bound the error's RMS by a fraction of the signal's (as HiFT's own tests do).
    """
    hops = [10, 8]
    speaker = backend.prepare_speaker(voice)
    streamed = torch.cat(stream_audio(backend, speaker, tokens, hops))
    layout = [*hops, tokens.numel() - sum(hops)]
    flow = backend.flow
    assert isinstance(flow, DiTFlow)
    with torch.inference_mode():
        mel = flow.offline(speaker.flow, tokens, chunk_layout=layout)
        reference, _ = backend.hift(mel, generator=torch.Generator().manual_seed(SEED))
    reference = reference[0]
    assert streamed.shape == reference.shape
    near_join = torch.zeros_like(reference, dtype=torch.bool)
    for k in range(len(hops)):
        join = SAMPLES_PER_TOKEN * sum(hops[: k + 1])
        near_join[join - HOLD_BACK: join + HOLD_BACK] = True
    torch.testing.assert_close(streamed[~near_join], reference[~near_join], atol=5e-4, rtol=0)
    error = (streamed[near_join] - reference[near_join]).pow(2).mean().sqrt()
    assert error < 0.2 * reference[near_join].pow(2).mean().sqrt()


def test_offline_contract(backend: TorchToken2Wav, voice: VoicePrompt, tokens: torch.Tensor) -> None:
    speaker = backend.prepare_speaker(voice)
    audio = backend.offline(speaker, tokens)
    assert audio.shape == (SAMPLES_PER_TOKEN * tokens.numel(),)
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1.0
    assert torch.equal(audio, backend.offline(speaker, tokens))  # fixed flow noise and vocoder seed
    assert backend.offline(speaker, tokens[:0]).numel() == 0


def test_streams_are_independent_and_closable(backend: TorchToken2Wav, voice: VoicePrompt,
                                              tokens: torch.Tensor) -> None:
    speaker = backend.prepare_speaker(voice)
    assert speaker.nbytes > 0
    first, second = backend.open_stream(speaker), backend.open_stream(speaker)
    a = backend.run_chunk(ChunkJob(first, tokens[:18], last=False))
    assert first.nbytes > 0
    first.close()
    first.close()
    assert first.nbytes == 0
    b = backend.run_chunk(ChunkJob(second, tokens[:18], last=False))
    torch.testing.assert_close(a, b)
    with pytest.raises(TypeError, match="TorchSpeaker"):
        backend.open_stream(speaker.flow)  # type: ignore[arg-type]


def test_from_models_dir_loads_the_dit_variant(tmp_path: Path, backend: TorchToken2Wav, voice: VoicePrompt,
                                               tokens: torch.Tensor) -> None:
    paths = ModelPaths(tmp_path)
    paths.step_audio2_token2wav.mkdir(parents=True)
    torch.save(backend.flow.state_dict(), paths.dit_flow)
    torch.save(HiFTGenerator(CONFIGS.hift).state_dict(), paths.hift)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    loaded = TorchToken2Wav.from_models_dir(tmp_path, "dit", "cpu")
    assert loaded.name == "torch-dit" and loaded.device == torch.device("cpu")
    with torch.inference_mode():
        ours = loaded.flow.offline(loaded.flow.prepare_speaker(voice), tokens[:12])
        theirs = backend.flow.offline(backend.flow.prepare_speaker(voice), tokens[:12])
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="unknown flow variant"):
        TorchToken2Wav.from_models_dir(tmp_path, "vits", "cpu")  # type: ignore[arg-type]


def test_from_models_dir_runs_the_unet_variant(tmp_path: Path, voice: VoicePrompt,
                                               tokens: torch.Tensor) -> None:
    """The same backend drives CosyVoice2's UNet flow (with CosyVoice2's HiFT file)."""
    paths = ModelPaths(tmp_path)
    paths.cosyvoice2.mkdir(parents=True)
    torch.manual_seed(4)
    torch.save(UNetFlow(CONFIGS.unet_flow).state_dict(), paths.unet_flow)
    torch.save(HiFTGenerator(CONFIGS.hift).state_dict(), paths.cosyvoice2_hift)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    backend = TorchToken2Wav.from_models_dir(tmp_path, "unet", "cpu")
    assert backend.name == "torch-unet" and isinstance(backend.flow, UNetFlow)
    pieces = stream_audio(backend, backend.prepare_speaker(voice), tokens, [10])
    audio = torch.cat(pieces)
    assert audio.numel() == SAMPLES_PER_TOKEN * tokens.numel()
    assert torch.isfinite(audio).all() and audio.abs().max() <= 1.0
