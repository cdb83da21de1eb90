"""`scripts/build_engines.py`: the synthetic tiny build end to end, idempotence, repair, download checks."""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import huggingface_hub.constants
import pytest
import soundfile
import torch
from safetensors.torch import load_file

from engines.build.download import COSYVOICE2, DownloadError, fetch, finalize_models_dir
from engines.build.manifest import check_manifest
from engines.build.synthetic import DEFAULT_VOICE_TEXT, build_random, voiced_clip
from engines.build.verify import CHECKPOINTS, verify_checkpoint, verify_models_dir
from engines.checkpoints import CheckpointError, load_checkpoint, load_strict
from engines.config import MANIFEST_NAME, ModelConfigs, ModelPaths, configs_for_models_dir
from engines.llm.hf_export import HF_BACKBONE_PREFIX
from engines.llm.model import LLM_BACKBONE_PREFIX
from engines.text import TextFrontend
from engines.voice import VoicePrompt

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "build_engines.py"
TINY = ModelConfigs.tiny()


def _load_cli() -> ModuleType:
    """The script as a module (it is a file, not part of a package)."""
    if "build_engines" not in sys.modules:
        spec = importlib.util.spec_from_file_location("build_engines", SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["build_engines"] = module  # dataclasses look their module up while being defined
        spec.loader.exec_module(module)
    return sys.modules["build_engines"]


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("models") / "tiny"
    assert _load_cli().main(["random", "--size", "tiny", "--out", str(out)]) == 0
    return out


@pytest.fixture
def copy(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built directory for tests that damage it."""
    return Path(shutil.copytree(built, tmp_path / "models"))


def _mtimes(root: Path) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file()}


def test_layout_matches_the_released_one(built: Path) -> None:
    paths = ModelPaths(built)
    required = [
        paths.llm, paths.unet_flow, paths.cosyvoice2_hift, paths.dit_flow, paths.hift, paths.campplus,
        paths.speech_tokenizer, paths.cosyvoice2 / "campplus.onnx",
        paths.cosyvoice2 / "speech_tokenizer_v2.onnx",
        paths.cosyvoice2 / "cosyvoice2.yaml", paths.step_audio2_token2wav / "flow.yaml",
        paths.voices / "default.safetensors", paths.voices / "default.wav", paths.manifest,
        *(paths.text_tokenizer / name for name in ("config.json", "vocab.json", "merges.txt",
                                                    "tokenizer_config.json", "model.safetensors")),
    ]
    assert [p for p in required if not p.is_file()] == []
    assert not list(built.rglob("*.partial")) and not list(built.rglob("*.tmp"))


def test_manifest_lists_every_file_with_its_hash(built: Path) -> None:
    manifest = check_manifest(built, size="tiny")
    assert manifest["source"] == "random"
    assert configs_for_models_dir(built) == TINY
    listed = {entry["path"] for entry in manifest["files"]}
    on_disk = {p.relative_to(built).as_posix() for p in built.rglob("*") if p.is_file()} - {MANIFEST_NAME}
    assert listed == on_disk
    newest = max(p.stat().st_mtime_ns for p in built.rglob("*") if p.is_file())
    assert (built / MANIFEST_NAME).stat().st_mtime_ns == newest  # written last


@pytest.mark.parametrize("spec", CHECKPOINTS, ids=[spec.name for spec in CHECKPOINTS])
def test_every_checkpoint_loads_strictly_into_our_module(built: Path, spec) -> None:
    state = load_checkpoint(spec.path(ModelPaths(built)))
    assert all(t.dtype == torch.float32 for t in state.values())
    load_strict(spec.module(TINY), spec.canonical(state), spec.name)


@pytest.mark.parametrize("spec", CHECKPOINTS, ids=[spec.name for spec in CHECKPOINTS])
def test_every_tensor_is_drawn(built: Path, spec) -> None:
    """No tensor left at a constant init: biases are not 0, norm gains and Snake α not 1 (a missing bias
    or affine would otherwise pass every test), and weight-norm magnitudes are positive."""
    state = load_checkpoint(spec.path(ModelPaths(built)))
    for name, tensor in state.items():
        if tensor.numel() > 1:
            assert float(tensor.std()) > 0, name
        if name.endswith("bias") and tensor.numel() > 1:
            assert float(tensor.abs().mean()) > 1e-3, name
        if name.endswith(".original0"):
            assert bool((tensor > 0).all()), name
    module = spec.module(TINY)
    gains = [name for name, sub in module.named_modules()
             if type(sub).__name__.endswith("Norm") and getattr(sub, "weight", None) is not None]
    assert all(not torch.allclose(state[f"{name}.weight"], torch.ones(1)) for name in gains)


def test_synthetic_hift_predicts_voiced_pitch(built: Path) -> None:
    """The harmonic source runs: 80–300 Hz on most frames of the default voice's prompt mel, of the
    synthetic flow's output and of standard-normal mels, with a pitch that moves."""
    from engines.token2wav.flow_dit import load_dit_flow
    from engines.token2wav.hift import load_hift

    paths = ModelPaths(built)
    voice = VoicePrompt.load(paths.voices / "default.safetensors")
    flow = load_dit_flow(paths.dit_flow, TINY.dit_flow, "cpu", torch.float32)
    tokens = torch.randint(0, TINY.dit_flow.vocab_size, (60,), generator=torch.Generator().manual_seed(0))
    mels = [voice.prompt_mel.T[None], flow.offline(flow.prepare_speaker(voice), tokens),
            torch.randn(1, 80, 200, generator=torch.Generator().manual_seed(1))]
    for path in (paths.hift, paths.cosyvoice2_hift):
        hift = load_hift(path, TINY.hift, "cpu")
        for mel in mels:
            with torch.no_grad():
                f0 = hift.f0_predictor(mel)
            assert float(((f0 > 80) & (f0 < 300)).float().mean()) > 0.9
            assert float(f0.std()) > 3


def test_llm_head_is_tied_and_blanken_holds_the_backbone(built: Path) -> None:
    paths = ModelPaths(built)
    llm = load_checkpoint(paths.llm)
    assert torch.equal(llm["llm.model.lm_head.weight"], llm["llm.model.model.embed_tokens.weight"])
    blanken = load_file(str(paths.text_tokenizer / "model.safetensors"))
    backbone = {k[len(LLM_BACKBONE_PREFIX):]: v for k, v in llm.items() if k.startswith(LLM_BACKBONE_PREFIX)}
    assert {k.removeprefix(HF_BACKBONE_PREFIX) for k in blanken} == set(backbone)
    name = "embed_tokens.weight"
    assert blanken[HF_BACKBONE_PREFIX + name].dtype == torch.bfloat16
    torch.testing.assert_close(blanken[HF_BACKBONE_PREFIX + name].float(), backbone[name], atol=1e-2,
                               rtol=1e-2)
    config = json.loads((paths.text_tokenizer / "config.json").read_text())
    assert config["hidden_size"] == TINY.llm.qwen.hidden_size
    assert config["vocab_size"] == TINY.llm.qwen.vocab_size


def test_tokenizer_round_trips_within_the_tiny_vocabulary(built: Path) -> None:
    frontend = TextFrontend(ModelPaths(built).text_tokenizer)
    text = "Hello, this is a realtime speech test. 你好！"
    ids = frontend.encode(text)
    assert frontend.decode(ids) == text
    assert frontend.vocab_size <= TINY.llm.qwen.vocab_size
    assert frontend.token_id("[mn]") == frontend.vocab_size - 1


def test_default_voice_is_encoded_from_the_default_clip(built: Path) -> None:
    paths = ModelPaths(built)
    voice = VoicePrompt.load(paths.voices / "default.safetensors")
    assert voice.prompt_text == DEFAULT_VOICE_TEXT
    clip, rate = soundfile.read(paths.voices / "default.wav", dtype="float32")
    assert rate == 24000 and 3.0 <= clip.size / rate <= 5.0
    assert voice.num_tokens == min(clip.size // 480 // 2, -(-(clip.size * 2 // 3 // 160) // 4))


def test_verify_command_accepts_the_build(built: Path) -> None:
    assert _load_cli().main(["verify", "--out", str(built)]) == 0


def test_second_run_changes_nothing(built: Path, caplog: pytest.LogCaptureFixture) -> None:
    before = _mtimes(built)
    with caplog.at_level(logging.INFO):
        build_random(built, "tiny")
    assert _mtimes(built) == before
    assert "nothing to do" in caplog.text


def test_a_corrupt_checkpoint_is_reported_and_rebuilt_alone(copy: Path) -> None:
    paths = ModelPaths(copy)
    damaged = bytearray(paths.dit_flow.read_bytes())
    damaged[:64] = bytes(64)  # same size, broken zip header
    paths.dit_flow.write_bytes(bytes(damaged))
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(paths.dit_flow)
    with pytest.raises(CheckpointError, match="sha256"):
        check_manifest(copy)
    before = _mtimes(copy)
    build_random(copy, "tiny")
    after = _mtimes(copy)
    rewritten = {p for p in before if after[p] != before[p]}
    assert rewritten == {paths.dit_flow, paths.manifest}
    check_manifest(copy, size="tiny")
    verify_checkpoint(paths.dit_flow, next(s for s in CHECKPOINTS if s.name == "dit_flow"), TINY)


def test_a_missing_checkpoint_fails_verification(copy: Path, caplog: pytest.LogCaptureFixture) -> None:
    ModelPaths(copy).hift.unlink()
    with pytest.raises(CheckpointError, match="does not exist"):
        verify_models_dir(copy, TINY)
    with caplog.at_level(logging.ERROR):
        assert _load_cli().main(["verify", "--out", str(copy)]) == 1
    assert "hift.pt" in caplog.text


def test_checkpoints_of_another_size_are_rejected(built: Path) -> None:
    spec = next(s for s in CHECKPOINTS if s.name == "hift")
    with pytest.raises(CheckpointError, match="wrong shape"):
        verify_checkpoint(ModelPaths(built).hift, spec, ModelConfigs.full())


def test_finalize_verifies_and_writes_the_manifest_last(copy: Path) -> None:
    (copy / MANIFEST_NAME).unlink()
    finalize_models_dir(copy, "tiny", "test-source")
    manifest = check_manifest(copy, size="tiny")
    assert manifest["source"] == "test-source"


def test_finalize_needs_a_reference_clip_for_the_default_voice(copy: Path, tmp_path: Path) -> None:
    paths = ModelPaths(copy)
    shutil.rmtree(paths.voices)
    with pytest.raises(DownloadError, match="--voice-wav"):
        finalize_models_dir(copy, "tiny", "test")
    assert not paths.manifest.exists()
    clip = tmp_path / "mine.wav"
    soundfile.write(clip, voiced_clip(seconds=0.5), 24000)
    with pytest.raises(DownloadError, match="audio_too_short"):
        finalize_models_dir(copy, "tiny", "test", voice_clip=clip, voice_text="x")
    soundfile.write(clip, voiced_clip(seconds=3.0, seed=5), 24000)
    finalize_models_dir(copy, "tiny", "test", voice_clip=clip, voice_text="My own voice.")
    assert VoicePrompt.load(paths.voices / "default.safetensors").prompt_text == "My own voice."
    check_manifest(copy, size="tiny")


def test_finalize_refuses_an_incomplete_download(copy: Path) -> None:
    (ModelPaths(copy).text_tokenizer / "merges.txt").unlink()
    with pytest.raises(CheckpointError, match="merges.txt"):
        finalize_models_dir(copy, "tiny", "test")
    assert not ModelPaths(copy).manifest.exists()


def test_download_without_network_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # never reach the network
    with pytest.raises(DownloadError, match="could not download FunAudioLLM/CosyVoice2-0.5B"):
        fetch(COSYVOICE2, tmp_path, "huggingface")


def test_modelscope_source_needs_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "modelscope", None)  # as if not installed
    with pytest.raises(DownloadError, match="modelscope"):
        fetch(COSYVOICE2, tmp_path, "modelscope")


def test_script_runs_as_a_file() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                            timeout=120, check=False, cwd="/")
    assert result.returncode == 0, result.stderr
    assert all(name in result.stdout for name in ("random", "download", "verify"))


def test_cli_registers_each_subcommand() -> None:
    cli = _load_cli()
    assert {"random", "download", "verify"} <= set(cli.COMMANDS)
    args = cli.parse_args(["random", "--size", "full", "--out", "/tmp/m"])
    assert (args.command, args.size, args.out) == ("random", "full", Path("/tmp/m"))
