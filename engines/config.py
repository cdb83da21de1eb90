"""Model architecture configurations.

`full()` presets are the released CosyVoice2-0.5B / Step-Audio-2-mini sizes (see
../shared/reference/MODEL_FACTS.md); `tiny()` presets keep every parameter name and every
dimension fixed by the data (80 mel bins, 6561 speech tokens, 192-d speaker vectors, 24 kHz and the
8·5·3 upsampling) but shrink the widths and depths, so CI runs the real architecture in seconds.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

ModelSize = Literal["tiny", "full"]

# Data-defined constants shared by every size.
SPEECH_CODEBOOK = 6561  # FSQ 3^8 speech tokens, 25 Hz
SPEECH_EOS = 6561
SPEECH_UNUSED_STOP = 6562
SPEECH_FILL = 6563
SPEECH_VOCAB = 6564  # codebook + eos + unused + fill
TOKEN_RATE_HZ = 25
MEL_BINS = 80
MEL_RATE_HZ = 50
TOKEN_MEL_RATIO = 2
SAMPLE_RATE = 24000
SAMPLES_PER_MEL_FRAME = 480
SAMPLES_PER_TOKEN = SAMPLES_PER_MEL_FRAME * TOKEN_MEL_RATIO  # 960
SPEAKER_EMBED_DIM = 192
PRE_LOOKAHEAD = 3
# The exponential schedule's hop once it reaches it (15, 25, 50, 100, then 200 on): token2wav captures its
# flow graphs on their own, the shorter hops' beside the first chunk's.
STEADY_HOP = 200


def _check_positive(obj: object) -> None:
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        value = getattr(obj, f.name)
        if isinstance(value, int) and not isinstance(value, bool) and value <= 0:
            raise ValueError(f"{type(obj).__name__}.{f.name} must be positive, got {value}")


@dataclass(frozen=True)
class Qwen2Config:
    hidden_size: int = 896
    num_layers: int = 24
    num_heads: int = 14
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 4864
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e6
    max_position_embeddings: int = 32768

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"num_heads*head_dim ({self.num_heads}*{self.head_dim}) != hidden_size {self.hidden_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )


@dataclass(frozen=True)
class LLMConfig:
    """CosyVoice2 `Qwen2LM`: Qwen2 backbone + sos/task embedding + speech embedding and head."""

    qwen: Qwen2Config = field(default_factory=Qwen2Config)
    speech_vocab: int = SPEECH_VOCAB
    sos_index: int = 0  # row of llm_embedding
    task_id_index: int = 1
    eos_token: int = SPEECH_EOS
    fill_token: int = SPEECH_FILL
    stop_tokens: tuple[int, ...] = (SPEECH_EOS, SPEECH_UNUSED_STOP, SPEECH_FILL)


@dataclass(frozen=True)
class ConformerConfig:
    """Upsample conformer encoder shared by both flows (MODEL_FACTS §4.2)."""

    d_model: int = 512
    num_heads: int = 8
    linear_units: int = 2048
    num_blocks: int = 6
    num_up_blocks: int = 4
    pre_lookahead: int = PRE_LOOKAHEAD
    up_stride: int = 2
    max_relative_len: int = 5000
    static_chunk_size: int = 25  # tokens; only the UNet flow's streaming masks use it

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not a multiple of num_heads {self.num_heads}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass(frozen=True)
class DiTConfig:
    """Step-Audio2 DiT estimator (MODEL_FACTS §5.2)."""

    in_channels: int = 320
    out_channels: int = MEL_BINS
    hidden_size: int = 512
    depth: int = 16
    num_heads: int = 8
    head_dim: int = 64
    mlp_ratio: float = 4.0
    time_embed_dim: int = 256

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"num_heads*head_dim ({self.num_heads}*{self.head_dim}) != hidden_size {self.hidden_size}"
            )


@dataclass(frozen=True)
class UNetConfig:
    """CosyVoice2 causal conditional UNet estimator (MODEL_FACTS §6.2)."""

    in_channels: int = 320
    out_channels: int = MEL_BINS
    channels: int = 256
    attention_head_dim: int = 64
    num_heads: int = 8
    n_blocks: int = 4
    num_mid_blocks: int = 12
    time_embed_dim: int = 1024
    static_chunk_size: int = 50  # mel frames

    def __post_init__(self) -> None:
        _check_positive(self)


@dataclass(frozen=True)
class FlowConfig:
    """Token → mel flow: embedding, conformer encoder, CFM with an estimator."""

    estimator_kind: Literal["dit", "unet"] = "dit"
    input_size: int = 512
    output_size: int = MEL_BINS
    spk_embed_dim: int = SPEAKER_EMBED_DIM
    vocab_size: int = SPEECH_CODEBOOK
    token_mel_ratio: int = TOKEN_MEL_RATIO
    n_timesteps: int = 10
    cfg_rate: float = 0.7
    encoder: ConformerConfig = field(default_factory=ConformerConfig)
    dit: DiTConfig = field(default_factory=DiTConfig)
    unet: UNetConfig = field(default_factory=UNetConfig)
    # Streaming DiT estimator cache (token2wav/dit_cache.py): the rule, and R, the frames it keeps
    # beyond the prompt's count. "reference" = Step-Audio2's driver; "prompt_recent" = an option.
    att_cache_rule: Literal["reference", "prompt_recent"] = "reference"  # = dit_cache.CacheRule
    att_cache_recent_frames: int = 100

    def __post_init__(self) -> None:
        if self.encoder.d_model != self.input_size:
            raise ValueError(f"encoder.d_model {self.encoder.d_model} != input_size {self.input_size}")


@dataclass(frozen=True)
class HiFTConfig:
    """HiFT (NSF + ISTFTNet) vocoder at 24 kHz (MODEL_FACTS §7)."""

    in_channels: int = MEL_BINS
    base_channels: int = 512
    nb_harmonics: int = 8
    sampling_rate: int = SAMPLE_RATE
    nsf_alpha: float = 0.1
    nsf_sigma: float = 0.003
    nsf_voiced_threshold: float = 10.0
    upsample_rates: tuple[int, ...] = (8, 5, 3)
    upsample_kernel_sizes: tuple[int, ...] = (16, 11, 7)
    istft_n_fft: int = 16
    istft_hop: int = 4
    resblock_kernel_sizes: tuple[int, ...] = (3, 7, 11)
    resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    source_resblock_kernel_sizes: tuple[int, ...] = (7, 7, 11)
    source_resblock_dilations: tuple[tuple[int, ...], ...] = ((1, 3, 5), (1, 3, 5), (1, 3, 5))
    lrelu_slope: float = 0.1
    audio_limit: float = 0.99
    f0_cond_channels: int = 512
    # Streaming: mel frames and source/speech samples carried into the next chunk.
    mel_cache_frames: int = 8
    source_cache_samples: int = 3840

    @property
    def hop_samples(self) -> int:
        prod = 1
        for r in self.upsample_rates:
            prod *= r
        return prod * self.istft_hop


@dataclass(frozen=True)
class ModelConfigs:
    """Every model's configuration for one model directory."""

    size: ModelSize
    llm: LLMConfig
    dit_flow: FlowConfig
    unet_flow: FlowConfig
    hift: HiFTConfig

    @staticmethod
    def full() -> ModelConfigs:
        encoder = ConformerConfig()
        return ModelConfigs(
            size="full",
            llm=LLMConfig(),
            dit_flow=FlowConfig(estimator_kind="dit", encoder=encoder),
            unet_flow=FlowConfig(estimator_kind="unet", encoder=encoder),
            hift=HiFTConfig(),
        )

    @staticmethod
    def tiny() -> ModelConfigs:
        qwen = Qwen2Config(
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=2048,
            max_position_embeddings=4096,
        )
        encoder = ConformerConfig(d_model=64, num_heads=2, linear_units=128, num_blocks=2, num_up_blocks=2)
        dit = DiTConfig(hidden_size=64, depth=2, num_heads=2, head_dim=32, time_embed_dim=32)
        unet = UNetConfig(
            channels=64,
            attention_head_dim=16,
            num_heads=2,
            n_blocks=1,
            num_mid_blocks=2,
            time_embed_dim=128,
        )
        return ModelConfigs(
            size="tiny",
            llm=LLMConfig(qwen=qwen),
            dit_flow=FlowConfig(estimator_kind="dit", input_size=64, encoder=encoder, dit=dit),
            unet_flow=FlowConfig(estimator_kind="unet", input_size=64, encoder=encoder, unet=unet),
            hift=HiFTConfig(base_channels=32, f0_cond_channels=32),
        )

    @staticmethod
    def for_size(size: ModelSize) -> ModelConfigs:
        if size == "full":
            return ModelConfigs.full()
        if size == "tiny":
            return ModelConfigs.tiny()
        raise ValueError(f"unknown model size {size!r}; expected 'tiny' or 'full'")


MANIFEST_NAME = "realtime-manifest.json"


def read_manifest(models_dir: Path) -> dict[str, Any]:
    """The manifest `scripts/build_engines.py` writes into a models directory."""
    path = Path(models_dir) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: run `python scripts/build_engines.py random --size tiny --out {models_dir}` "
            f"or `python scripts/build_engines.py download --out {models_dir}` first"
        )
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return manifest


def configs_for_models_dir(models_dir: Path) -> ModelConfigs:
    """Architecture of the models in `models_dir`, read from its manifest's `size`."""
    manifest = read_manifest(models_dir)
    size = manifest.get("size")
    if size not in ("tiny", "full"):
        raise ValueError(f"{Path(models_dir) / MANIFEST_NAME}: 'size' must be 'tiny' or 'full', got {size!r}")
    return ModelConfigs.for_size(size)


@dataclass(frozen=True)
class ModelPaths:
    """Where each file lives inside a models directory (the released on-disk layout)."""

    root: Path

    @property
    def cosyvoice2(self) -> Path:
        return self.root / "CosyVoice2-0.5B"

    @property
    def step_audio2_token2wav(self) -> Path:
        return self.root / "Step-Audio-2-mini" / "token2wav"

    @property
    def llm(self) -> Path:
        return self.cosyvoice2 / "llm.pt"

    @property
    def text_tokenizer(self) -> Path:
        return self.cosyvoice2 / "CosyVoice-BlankEN"

    @property
    def unet_flow(self) -> Path:
        return self.cosyvoice2 / "flow.pt"

    @property
    def dit_flow(self) -> Path:
        return self.step_audio2_token2wav / "flow.pt"

    @property
    def hift(self) -> Path:
        return self.step_audio2_token2wav / "hift.pt"

    @property
    def cosyvoice2_hift(self) -> Path:
        return self.cosyvoice2 / "hift.pt"

    @property
    def campplus(self) -> Path:
        return self.step_audio2_token2wav / "campplus.onnx"

    @property
    def speech_tokenizer(self) -> Path:
        return self.step_audio2_token2wav / "speech_tokenizer_v2_25hz.onnx"

    @property
    def hf_llm(self) -> Path:
        """The LLM converted to a Hugging Face Qwen2 checkpoint (TensorRT-LLM's input)."""
        return self.root / "cosyvoice2-llm-hf"

    @property
    def engines(self) -> Path:
        """TensorRT-LLM engine and TensorRT plans built from the checkpoints."""
        return self.root / "engines"

    @property
    def voices(self) -> Path:
        return self.root / "voices"

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST_NAME
