"""The service picks its engines through engines/*/auto.py: `auto` falls back to PyTorch and says why,
a backend asked for by name that cannot run stops the start with the reason."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from engines.llm.torch_engine import TorchLLMEngine
from engines.token2wav.torch_backend import TorchToken2Wav
from realtime.cli import _config, build_parser
from realtime.config import ServiceConfig
from realtime.engine_loader import load_engines
from realtime.runtime import Runtime


def config(models: Path, **overrides: object) -> ServiceConfig:
    return ServiceConfig(models_dir=models, device="cpu", max_streams=2, **overrides)  # type: ignore[arg-type]


def test_auto_picks_pytorch_without_built_engines_and_logs_why(
    tiny_models: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="engines"):
        engines = load_engines(config(tiny_models))
    (llm,), (token2wav,) = engines.llms, engines.token2wavs
    assert llm.name == "torch"
    assert isinstance(token2wav, TorchToken2Wav)
    assert llm.stats().max_slots == 2
    picks = {record.name: record.getMessage() for record in caplog.records}
    assert picks["engines.llm.auto"] == "LLM engine: PyTorch (TensorRT-LLM needs a CUDA device, not 'cpu')"
    assert picks["engines.token2wav.auto"] == (
        "token2wav backend: PyTorch dit flow (TensorRT needs a CUDA device, not 'cpu')"
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"llm_backend": "tensorrt_llm"}, "TensorRT-LLM engine cannot run: TensorRT-LLM needs a CUDA device"),
        ({"token2wav_backend": "tensorrt"}, "TensorRT token2wav backend cannot run: TensorRT needs a CUDA"),
    ],
)
async def test_a_backend_asked_for_by_name_that_cannot_run_stops_the_start(
    tiny_models: Path, overrides: dict[str, object], message: str
) -> None:
    runtime = Runtime(config(tiny_models, **overrides))
    with pytest.raises(RuntimeError, match=message):
        await runtime.start()
    assert not runtime.ready


def test_cli_backend_names_are_the_config_names(tiny_models: Path) -> None:
    backends = ["--llm-backend", "tensorrt_llm", "--token2wav-backend", "tensorrt"]
    args = build_parser().parse_args(["serve", "--models", str(tiny_models), *backends])
    chosen = _config(args)
    assert (chosen.llm_backend, chosen.token2wav_backend) == ("tensorrt_llm", "tensorrt")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--llm-backend", "trtllm"])
    with pytest.raises(ValueError, match="token2wav_backend must be one of"):
        config(tiny_models, token2wav_backend="trt")


def _served_token2wav(tiny_models: Path, *flags: str) -> TorchToken2Wav:
    """The token2wav engine `serve --models tiny_models *flags` loads on the CPU."""
    args = build_parser().parse_args(["serve", "--models", str(tiny_models), *flags])
    engines = load_engines(dataclasses.replace(_config(args), device="cpu", max_streams=2))
    (token2wav,) = engines.token2wavs
    assert isinstance(token2wav, TorchToken2Wav)
    return token2wav


def test_dit_cache_rule_reaches_the_flow(tiny_models: Path) -> None:
    """`--dit-cache-rule` (default: the reference's) selects the flow's estimator-cache rule."""
    default = _config(build_parser().parse_args(["serve", "--models", str(tiny_models)]))
    assert default.dit_cache_rule == "reference"
    token2wav = _served_token2wav(tiny_models, "--dit-cache-rule", "prompt_recent")
    assert token2wav.flow.cfg.att_cache_rule == "prompt_recent"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--dit-cache-rule", "newest"])
    with pytest.raises(ValueError, match="dit_cache_rule must be one of"):
        config(tiny_models, dit_cache_rule="newest")


def test_vocoder_precision_reaches_hift(tiny_models: Path) -> None:
    """`--vocoder-precision` (default: float32, the reference's) is HiFT's decoder's dtype; the pitch
    predictor stays float32."""
    default = _config(build_parser().parse_args(["serve", "--models", str(tiny_models)]))
    assert default.vocoder_precision == "float32"
    token2wav = _served_token2wav(tiny_models, "--vocoder-precision", "float16")
    assert (token2wav.hift.decoder_dtype, token2wav.hift.input_dtype) == (torch.float16, torch.float32)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--vocoder-precision", "float8"])
    with pytest.raises(ValueError, match="vocoder_precision must be one of"):
        config(tiny_models, vocoder_precision="half")


def test_llm_prefill_padding_reaches_the_llm_engine(tiny_models: Path) -> None:
    """`--llm-prefill-padding` (default: no limit) is the PyTorch LLM's `prefill_padding_limit`."""
    default = _config(build_parser().parse_args(["serve", "--models", str(tiny_models)]))
    assert default.llm_prefill_padding is None
    args = build_parser().parse_args(["serve", "--models", str(tiny_models), "--llm-prefill-padding", "1024"])
    engines = load_engines(dataclasses.replace(_config(args), device="cpu", max_streams=2))
    (llm,) = engines.llms
    assert isinstance(llm, TorchLLMEngine) and llm.config.prefill_padding_limit == 1024
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--llm-prefill-padding", "-1"])
    with pytest.raises(ValueError, match="llm_prefill_padding"):
        config(tiny_models, llm_prefill_padding=-1)
