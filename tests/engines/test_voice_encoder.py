"""Voice prompt extraction with the synthetic ONNX front ends (same contracts as the released ones)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from engines.audio_features import flow_mel
from engines.build.onnx_models import export_campplus, export_speech_tokenizer
from engines.build.synthetic import voiced_clip
from engines.config import SPEECH_CODEBOOK
from engines.resample import resample
from engines.voice import VoicePrompt
from engines.voice_encoder import VoiceEncoder, VoiceError, VoiceLimits, onnx_providers

RATE = 24000


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> VoiceEncoder:
    directory = tmp_path_factory.mktemp("onnx")
    export_speech_tokenizer(directory / "speech_tokenizer.onnx", seed=0)
    export_campplus(directory / "campplus.onnx", seed=1)
    return VoiceEncoder(directory / "speech_tokenizer.onnx", directory / "campplus.onnx", device="cpu")


def _wav(samples: np.ndarray, rate: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="FLOAT")
    return buffer.getvalue()


def test_prompt_tokens_and_mel_are_aligned(encoder: VoiceEncoder) -> None:
    clip = voiced_clip(seconds=4.0)
    voice = encoder.encode(clip, "  a transcript ", sample_rate=RATE)
    # 4 s: 200 flow-mel frames, 400 Whisper frames → 100 tokens; n = min(200 // 2, 100).
    assert voice.num_tokens == 100
    assert voice.prompt_mel.shape == (200, 80)
    assert voice.prompt_text == "a transcript"
    assert voice.speech_tokens.dtype == torch.int64
    assert int(voice.speech_tokens.min()) >= 0 and int(voice.speech_tokens.max()) < SPEECH_CODEBOOK
    torch.testing.assert_close(voice.prompt_mel, flow_mel(clip)[:200])
    assert voice.speaker_embedding.shape == (192,) and torch.isfinite(voice.speaker_embedding).all()


def test_odd_lengths_crop_to_the_shorter_stream(encoder: VoiceEncoder) -> None:
    clip = voiced_clip(seconds=2.0)[: RATE * 2 - 500]  # 98 mel frames; 197 Whisper frames → 50 tokens
    voice = encoder.encode(clip, "text", sample_rate=RATE)
    assert voice.num_tokens == 49
    assert voice.prompt_mel.shape == (98, 80)


def test_features_depend_on_the_clip_and_are_deterministic(encoder: VoiceEncoder) -> None:
    a = encoder.encode(voiced_clip(seed=0), "text", sample_rate=RATE)
    again = encoder.encode(voiced_clip(seed=0), "text", sample_rate=RATE)
    higher = voiced_clip(seed=0)
    b = encoder.encode(resample(higher, RATE, int(RATE * 0.8)), "text", sample_rate=RATE)  # pitched up
    torch.testing.assert_close(a.speaker_embedding, again.speaker_embedding)
    assert torch.equal(a.speech_tokens, again.speech_tokens)
    assert not torch.allclose(a.speaker_embedding, b.speaker_embedding)
    assert len(set(a.speech_tokens.tolist())) > 1


def test_bytes_files_and_arrays_give_the_same_voice(encoder: VoiceEncoder, tmp_path: Path) -> None:
    clip = voiced_clip(seconds=3.0)
    from_array = encoder.encode(clip, "text", sample_rate=RATE)
    from_bytes = encoder.encode(_wav(clip, RATE), "text")
    path = tmp_path / "clip.wav"
    path.write_bytes(_wav(np.stack([clip, clip], axis=1), RATE))
    from_file = encoder.encode(path, "text")
    for other in (from_bytes, from_file):
        assert torch.equal(other.speech_tokens, from_array.speech_tokens)
        torch.testing.assert_close(other.speaker_embedding, from_array.speaker_embedding)


def test_any_sample_rate_is_accepted(encoder: VoiceEncoder) -> None:
    clip = resample(voiced_clip(seconds=3.0), RATE, 44100)
    voice = encoder.encode(clip, "text", sample_rate=44100)
    assert voice.num_tokens == 75


def test_a_rate_without_a_usable_common_factor_is_refused_with_a_code(encoder: VoiceEncoder) -> None:
    # 44099 Hz and 16 kHz share no factor: torchaudio's table would be 16000 × 44133 taps.
    with pytest.raises(VoiceError) as info:
        encoder.encode(voiced_clip(seconds=2.0), "text", sample_rate=44099)
    assert info.value.code == "unsupported_sample_rate"


def test_voice_round_trips_through_a_file(encoder: VoiceEncoder, tmp_path: Path) -> None:
    voice = encoder.encode(voiced_clip(), "round trip", sample_rate=RATE)
    voice.save(tmp_path / "v.safetensors")
    loaded = VoicePrompt.load(tmp_path / "v.safetensors")
    assert loaded.prompt_text == "round trip"
    assert torch.equal(loaded.speech_tokens, voice.speech_tokens)


@pytest.mark.parametrize(
    ("audio", "code"),
    [
        (np.zeros(RATE * 3, dtype=np.float32), "silent_audio"),
        (voiced_clip(seconds=0.5), "audio_too_short"),
        (np.tile(voiced_clip(seconds=4.0), 8), "audio_too_long"),
        (np.full(RATE * 2, np.nan, dtype=np.float32), "invalid_audio"),
    ],
)
def test_unusable_clips_are_rejected_with_a_code(encoder: VoiceEncoder, audio: np.ndarray, code: str) -> None:
    with pytest.raises(VoiceError) as info:
        encoder.encode(audio, "text", sample_rate=RATE)
    assert info.value.code == code


def test_non_audio_bytes_and_empty_transcripts_are_rejected(encoder: VoiceEncoder, tmp_path: Path) -> None:
    with pytest.raises(VoiceError) as info:
        encoder.encode(b"definitely not audio" * 100, "text")
    assert info.value.code == "invalid_audio"
    with pytest.raises(VoiceError) as info:
        encoder.encode(tmp_path / "missing.wav", "text")
    assert info.value.code == "invalid_audio"
    with pytest.raises(VoiceError) as info:
        encoder.encode(voiced_clip(), "  \n ", sample_rate=RATE)
    assert info.value.code == "empty_transcript"


def test_limits_are_configurable_and_checked() -> None:
    assert VoiceLimits(min_seconds=0.5, max_seconds=10.0).max_seconds == 10.0
    with pytest.raises(ValueError):
        VoiceLimits(min_seconds=5.0, max_seconds=2.0)
    with pytest.raises(ValueError):
        VoiceLimits(max_seconds=60.0)  # the speech tokenizer takes at most 30 s in one call


def test_cpu_provider_is_always_available() -> None:
    assert onnx_providers("cpu") == ["CPUExecutionProvider"]
    assert onnx_providers("auto")[-1] == "CPUExecutionProvider"
    with pytest.raises(ValueError):
        onnx_providers("tpu")
