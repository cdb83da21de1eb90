"""The command line as a user meets it: help with defaults, each command's own options, and start-up
errors as one line and a non-zero exit before any engine loads."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from realtime.batch_policy import FirstChunkHold
from realtime.cli import _config, build_parser, main
from realtime.config import ServiceConfig
from realtime.schedule import FirstChunkByLoad

REPO = Path(__file__).resolve().parents[2]


def help_of(command: str, capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out


def test_help_shows_defaults_and_synth_lists_only_its_own_options(capsys):
    serve = help_of("serve", capsys)
    assert "(default: 8080)" in serve and "(default: 127.0.0.1)" in serve and "--drain-timeout" in serve
    synth = help_of("synth", capsys)
    assert "(default: speech.wav)" in synth
    serve_only = ("--port", "--host", "--drain-timeout", "--advertise-address", "--ice-server", "--api-key")
    assert not [option for option in serve_only if option in synth]


def serve_fails(*args: str) -> str:
    """stderr of `realtime serve ARGS`, which must fail at once with exit code 2 and no traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "realtime", "serve", *args],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_missing_models_directory_is_one_line():
    assert "/nonexistent is not a directory" in serve_fails("--models", "/nonexistent")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_one_line(tiny_models):
    assert "try --device cpu" in serve_fails("--models", str(tiny_models), "--device", "cuda")


def test_a_taken_port_is_found_before_the_engines_load(tiny_models):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = serve_fails("--models", str(tiny_models), "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in line


def test_scheduling_flags_reach_the_service_config(tmp_path):
    def config(*flags: str) -> ServiceConfig:
        return _config(build_parser().parse_args(["serve", "--models", str(tmp_path), *flags]))

    default = config()
    assert default.token2wav_batch == 64 and default.token2wav_solve_bytes == 16 << 30
    assert default.first_chunk_hold == FirstChunkHold()
    tuned = config("--token2wav-solve-gib", "0", "--first-chunk-gap-ms", "6", "--first-chunk-hold-ms", "20")
    assert tuned.token2wav_solve_bytes is None
    assert tuned.first_chunk_hold == FirstChunkHold(gap_s=0.006, max_s=0.020)
    assert default.token2wav_call_tokens is None
    assert default.urgent_chunk_calls == 2.0
    assert config("--urgent-chunk-calls", "0").urgent_chunk_calls == 0
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            config("--urgent-chunk-calls", bad)
    assert config("--token2wav-call-tokens", "800").token2wav_call_tokens == 800
    assert config("--token2wav-call-tokens", "0").token2wav_call_tokens is None
    with pytest.raises(SystemExit):
        config("--token2wav-call-tokens", "-5")
    assert default.final_chunk_graphs
    assert not config("--no-final-chunk-graphs").final_chunk_graphs
    assert default.gil_switch_s == 0.005 and config("--gil-switch-ms", "0.5").gil_switch_s == 0.0005
    for bad in ("0", "-1", "nan", "2000"):
        with pytest.raises(ValueError, match="gil_switch_s"):
            config("--gil-switch-ms", bad)
    assert default.first_chunk_tokens == 15 and config("--first-chunk-tokens", "10").first_chunk_tokens == 10
    for bad in ("4", "101", "x"):
        with pytest.raises(SystemExit):
            config("--first-chunk-tokens", bad)
    for bad_tokens in (4, 101):
        with pytest.raises(ValueError, match="first_chunk_tokens must be in 5..100"):
            ServiceConfig(models_dir=tmp_path, first_chunk_tokens=bad_tokens)
        with pytest.raises(ValueError, match="light_load_first_chunk_tokens must be in 5..100"):
            ServiceConfig(models_dir=tmp_path, light_load_first_chunk_tokens=bad_tokens)
    with pytest.raises(ValueError, match="light_load_streams must be >= 0, got -1"):
        ServiceConfig(models_dir=tmp_path, light_load_streams=-1)
    assert default.first_chunk_rule == FirstChunkByLoad(15, 10, 0)  # off: first hops (15,)
    assert default.first_chunk_rule.first_hops == (15,)
    light = config("--light-load-first-chunk-tokens", "8", "--light-load-streams", "4").first_chunk_rule
    assert light == FirstChunkByLoad(15, 8, 4) and light.first_hops == (15, 8)
    assert config("--light-load-streams", "4", "--baseline").light_load_streams == 0
    for flag, bad in (("--light-load-first-chunk-tokens", "4"), ("--light-load-streams", "-1")):
        with pytest.raises(SystemExit):
            config(flag, bad)


def test_a_bad_bench_option_is_refused_with_a_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--search-repeats", "0", "--no-baseline"]) == 2
    assert "realtime bench: search_repeats must be positive, got 0" in capsys.readouterr().err
