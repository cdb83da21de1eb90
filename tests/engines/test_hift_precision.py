"""HiFT with its decoder in a half precision (`HiFTGenerator.use_decoder_dtype`, not the reference's
numerics): the pitch and the harmonic source stay float32 and equal the float32 model's, the speech stays
within the half's rounding of it, on the CPU and through the GPU's kernels and graphs."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from test_hift_layout import _time_major
from test_hift_snake import snake_definition
from weights import randomize

from engines.config import MANIFEST_NAME, SAMPLES_PER_TOKEN, ModelConfigs, ModelPaths
from engines.token2wav.base import ChunkJob
from engines.token2wav.flow_dit import DiTFlow
from engines.token2wav.hift import HiFTGenerator, fold_weight_norm
from engines.token2wav.torch_backend import TorchToken2Wav
from engines.token2wav.vocoder_graphs import GraphedVocoder
from engines.voice import VoicePrompt

TINY = ModelConfigs.tiny()
TINY_HIFT = TINY.hift
CUDA = torch.device("cuda")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Speech error RMS over speech RMS, half decoder against float32, for the weights of `hift_in_range`
# (CPU, tiny model: float16 0.3 %, bfloat16 2.7 %; a decoder left in float32 by mistake gives 0).
BOUNDS = {torch.float16: 1e-2, torch.bfloat16: 6e-2}


def hift_in_range() -> HiFTGenerator:
    """A tiny HiFT with weights where nothing is zero, conv_post scaled so its log-magnitudes and phases
    are O(1) as a trained model's are (unscaled, exp and sin of values near 80 turn any rounding into
    noise: no precision could be judged)."""
    hift = HiFTGenerator(TINY_HIFT).eval()
    randomize(hift, seed=7)
    fold_weight_norm(hift)
    with torch.no_grad():
        hift.conv_post.weight.mul_(0.1)
    return hift


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt())


def inputs(rows: int, frames: int, hift: HiFTGenerator) -> tuple[torch.Tensor, torch.Tensor]:
    mel = torch.randn(rows, 80, frames, generator=torch.Generator().manual_seed(1))
    noise = hift.draw_noise(torch.Generator().manual_seed(2), rows, frames * hift.hop_samples,
                            torch.device("cpu"))
    return mel, noise


def test_only_the_decoder_changes_dtype() -> None:
    hift = hift_in_range()
    hift.use_decoder_dtype(torch.bfloat16)
    assert hift.decoder_dtype == torch.bfloat16 and hift.input_dtype == torch.float32
    for part in (hift.conv_pre, hift.ups, hift.source_downs, hift.resblocks, hift.source_resblocks):
        assert {p.dtype for p in part.parameters()} == {torch.bfloat16}
    for part in (hift.f0_predictor, hift.m_source, hift.conv_post):
        assert {p.dtype for p in part.parameters()} == {torch.float32}
    assert {b.dtype for b in hift.buffers()} <= {torch.float32, torch.float64}
    with pytest.raises(ValueError, match="decoder runs in one of"):
        hift.use_decoder_dtype(torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_decoder_keeps_the_source_and_stays_near_the_speech(dtype: torch.dtype) -> None:
    """A plain and a right-padded batch: the source bit for bit, the speech float32 within the bound,
    and the padded row silent past its end as in float32."""
    hift = hift_in_range()
    half = copy.deepcopy(hift)
    half.use_decoder_dtype(dtype)
    mel, noise = inputs(2, 40, hift)
    frames = torch.tensor([40, 23])
    with torch.inference_mode():
        for row_frames in (None, frames):
            want = hift.vocode_with_noise(mel, None, noise, row_frames)
            got = half.vocode_with_noise(mel, None, noise, row_frames)
            assert got.speech.dtype == torch.float32 and got.source.dtype == torch.float32
            torch.testing.assert_close(got.source, want.source, rtol=0, atol=0)
            assert want.speech.abs().amax() > 0.05
            assert 0 < relative_error(got.speech, want.speech) < BOUNDS[dtype]
            if row_frames is not None:
                assert not bool(got.speech[1, 23 * hift.hop_samples:].any())


def test_a_backend_streams_with_a_half_decoder(tmp_path: Path) -> None:
    """`from_models_dir(vocoder_dtype=…)`: streaming chunks through HiFTStream's joins and caches with a
    float16 decoder give the float32 backend's audio within the bound."""
    paths = ModelPaths(tmp_path)
    paths.step_audio2_token2wav.mkdir(parents=True)
    torch.manual_seed(0)
    torch.save(DiTFlow(TINY.dit_flow).state_dict(), paths.dit_flow)
    hift = HiFTGenerator(TINY_HIFT)
    randomize(hift, seed=7)
    torch.save(hift.state_dict(), paths.hift)
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"size": "tiny"}))
    generator = torch.Generator().manual_seed(2)
    voice = VoicePrompt(prompt_text="prompt",
                        speech_tokens=torch.randint(0, 6561, (10,), generator=generator),
                        speaker_embedding=torch.randn(192, generator=generator),
                        prompt_mel=torch.randn(20, 80, generator=generator))
    tokens = torch.cat([voice.speech_tokens[:3], torch.randint(0, 6561, (25,), generator=generator)])
    audio = {}
    for dtype in (torch.float32, torch.float16):
        backend = TorchToken2Wav.from_models_dir(tmp_path, "dit", "cpu", vocoder_dtype=dtype)
        assert backend.hift.decoder_dtype == dtype
        backend.vocoder_seed = 11  # the same NSF noise on both sides
        with torch.no_grad():
            backend.hift.conv_post.weight.mul_(0.1)  # as `hift_in_range`
        stream = backend.open_stream(backend.prepare_speaker(voice))
        lookahead = TINY.dit_flow.encoder.pre_lookahead
        first = backend.run_chunk(ChunkJob(stream, tokens[:10 + lookahead], last=False))
        audio[dtype] = torch.cat([first, backend.run_chunk(ChunkJob(stream, tokens[10:], last=True))])
    assert audio[torch.float16].numel() == SAMPLES_PER_TOKEN * tokens.numel()
    assert 0 < relative_error(audio[torch.float16], audio[torch.float32]) < BOUNDS[torch.float16]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_snake_kernels_compute_half_activations_in_float32(dtype: torch.dtype) -> None:
    """Half inputs (activation, α, bias, residual): the definition in float32 of those values, then
    rounded once to the half, in the activation's layout."""
    from engines.token2wav.snake import residual_snake, snake  # Triton: with CUDA torch only

    generator = torch.Generator().manual_seed(3)
    x = _time_major((3 * torch.randn(3, 64, 701, generator=generator)).to(CUDA, dtype))
    residual = _time_major(torch.randn(3, 64, 701, generator=generator).to(CUDA, dtype))
    alpha = (torch.rand(64, generator=generator) * 2 + 0.05).to(CUDA, dtype)
    alpha[0] = -0.7
    bias = (0.3 * torch.randn(64, generator=generator)).to(CUDA, dtype)
    ends = torch.tensor([701, 1, 350], device=CUDA)
    exact = {"rtol": torch.finfo(dtype).eps, "atol": torch.finfo(dtype).eps}  # one rounding apart at most

    got = snake(x, alpha, ends, bias)
    want = snake_definition(x.float() + bias.float()[None, :, None], alpha.float(), ends).to(dtype)
    assert got.dtype == dtype and got.stride() == x.stride()
    torch.testing.assert_close(got, want, **exact)

    total, activated = residual_snake(x, bias, residual, alpha, ends)
    sum_ = x.float() + bias.float()[None, :, None] + residual.float()
    assert activated is not None
    torch.testing.assert_close(total, sum_.to(dtype), **exact)
    torch.testing.assert_close(activated, snake_definition(sum_, alpha.float(), ends).to(dtype), **exact)

    channel_major = snake(x.contiguous(), alpha)
    torch.testing.assert_close(channel_major, snake_definition(x.float(), alpha.float()).to(dtype), **exact)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_half_decoder_on_the_gpu_and_in_its_graphs(dtype: torch.dtype,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's time-major half decoder (cuDNN's half convolutions, the Snake kernels), eagerly and from
    a CUDA graph, against the float32 model on the CPU: within the bound, the source unchanged. The
    float32 parts in IEEE float32 (the service runs them in TF32), so that the GPU's pitch and source are
    the CPU's up to rounding."""
    monkeypatch.setattr(torch.backends.cudnn.conv, "fp32_precision", "ieee")
    monkeypatch.setattr(torch.backends.cuda.matmul, "fp32_precision", "ieee")
    hift = hift_in_range()
    mel, noise = inputs(2, 20, hift)
    with torch.inference_mode():
        want = hift.vocode_with_noise(mel, None, noise)
        half = copy.deepcopy(hift).to(CUDA)
        half.use_decoder_dtype(dtype)
        eager = half.vocode_with_noise(mel.to(CUDA), None, noise.to(CUDA))
        graphed = GraphedVocoder(half, [(20, 0)], batches=(2,)).vocode(mel.to(CUDA), None, noise.to(CUDA))
    for got in (eager, graphed):
        torch.testing.assert_close(got.source.cpu(), want.source, rtol=1e-3, atol=1e-3)
        assert 0 < relative_error(got.speech.cpu(), want.speech) < BOUNDS[dtype]
    torch.testing.assert_close(graphed.speech, eager.speech, rtol=0, atol=1e-3)
