"""Service configuration: one frozen, validated dataclass built by the CLI (or by tests)."""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

from engines.llm.auto import LLMBackend
from engines.token2wav.auto import Token2WavBackend
from engines.token2wav.dit_cache import CACHE_RULES, CacheRule
from realtime.batch_policy import FirstChunkHold
from realtime.placement import DevicePlan, PlacementKind, plan_devices
from realtime.schedule import ExponentialHops, FirstChunkByLoad, ScheduleKind
from realtime.voice_aliases import DEFAULT_VOICE_ALIASES

FlowKind = Literal["dit", "unet"]
VocoderPrecision = Literal["float32", "float16", "bfloat16"]
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "cosyvoice-realtime"
GIB = 1 << 30
# A first chunk of 4 tokens is 8 mel frames, all of which HiFT holds back for the next chunk: no audio.
MIN_FIRST_CHUNK_TOKENS = 5
MAX_FIRST_CHUNK_TOKENS = 100


def _require_above_zero(config: object, names: Iterable[str], label: str = "") -> None:
    """ValueError for the first of `names` whose value in `config` is not > 0."""
    for name in names:
        if not getattr(config, name) > 0:
            raise ValueError(f"{label}{name} must be > 0, got {getattr(config, name)}")


def _require_at_least_one(config: object, names: Iterable[str]) -> None:
    """ValueError for the first of `names` whose value in `config` is below 1."""
    for name in names:
        if getattr(config, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(config, name)}")


_ICE_URL_SCHEMES = ("stun:", "stuns:", "turn:", "turns:")


@dataclass(frozen=True)
class IceServer:
    """A STUN or TURN server, written as a browser's RTCIceServer (`turn:host:3478?transport=udp`)."""

    url: str
    username: str | None = None
    credential: str | None = None

    def __post_init__(self) -> None:
        if not self.url.startswith(_ICE_URL_SCHEMES):
            raise ValueError(f"ICE server url must start with one of {_ICE_URL_SCHEMES}, got {self.url!r}")
        if self.url.startswith("turn") and (self.username is None or self.credential is None):
            raise ValueError(f"TURN server {self.url!r} needs a username and a credential")


@dataclass(frozen=True)
class WebRTCConfig:
    """The WebRTC transport's limits and network policy.

    max_sessions: peer connections at once; more offers are refused.
    connect_timeout_s: a session whose connection is not up this long after the answer is closed.
    playout_buffer_s: speech buffered ahead of playout per session before the stream is throttled.
    host_addresses: local addresses to bind and advertise as ICE host candidates (None: every
    interface except loopback, aiortc's default); e.g. ("127.0.0.1",) for loopback only.
    ice_servers: STUN/TURN servers (aiortc uses at most one of each); none by default, so no traffic
    goes to any third party.
    """

    max_sessions: int = 16
    connect_timeout_s: float = 10.0
    playout_buffer_s: float = 30.0
    host_addresses: tuple[str, ...] | None = None
    ice_servers: tuple[IceServer, ...] = ()

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"webrtc max_sessions must be >= 1, got {self.max_sessions}")
        _require_above_zero(self, ("connect_timeout_s", "playout_buffer_s"), "webrtc ")
        if self.host_addresses is not None:
            if not self.host_addresses:
                raise ValueError("webrtc host_addresses is empty: give at least one address, or None for all")
            for address in self.host_addresses:
                try:
                    ipaddress.ip_address(address)
                except ValueError:
                    raise ValueError(f"webrtc host address must be an IP address, got {address!r}") from None


@dataclass(frozen=True)
class AccessConfig:
    """Who may use the service, and from which web origins.

    api_keys: accepted API keys; none leaves the service open (a warning at start when it listens
    beyond loopback). Each key is its own principal: rate, connection and voice limits are per key,
    and a voice belongs to the key that uploaded it. Without keys the principal is the client's IP.
    cors_origins: web origins (`https://app.example`) other than the service's own that browsers may
    call it from; `*` allows any. Browser requests from any other origin (websockets and WebRTC
    signalling included) are refused.
    """

    api_keys: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for key in self.api_keys:
            if len(key) < 8 or not key.isprintable() or any(c.isspace() for c in key):
                raise ValueError("API keys must be at least 8 printable characters without spaces")
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(f"CORS origins look like https://host[:port] or '*', got {origin!r}")

    @property
    def open(self) -> bool:
        return not self.api_keys


@dataclass(frozen=True)
class LimitsConfig:
    """Per-client limits (a client is an API key, or an IP address when the service has no keys).

    requests_per_s / request_burst: a token bucket of HTTP requests, websocket connections and WebRTC
        offers per client.
    connections_per_client: websockets and HTTP requests in progress at once per client.
    header_timeout_s: time a client has to send a request's headers.
    body_timeout_s: longest wait for the next piece of a request body.
    ws_idle_timeout_s: a websocket with no message from the client and nothing being spoken this long
        is closed.
    context_idle_timeout_s: a context holding text not yet spoken (no flush, no end) that receives
        nothing this long is ended with `context_timeout`.
    queued_sentences: texts queued for speaking per context; more get `queue_full`.
    pending_offers_per_client: WebRTC sessions answered and not yet connected, per client.
    voices_per_client / voice_bytes_per_client: uploaded voices (count, bytes on disk) per client.
    voices_total / voice_bytes_total: the same, all clients together.
    """

    requests_per_s: float = 50.0
    request_burst: int = 500
    connections_per_client: int = 256
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    ws_idle_timeout_s: float = 300.0
    context_idle_timeout_s: float = 60.0
    queued_sentences: int = 64
    pending_offers_per_client: int = 4
    voices_per_client: int = 32
    voice_bytes_per_client: int = 32 * 1024 * 1024
    voices_total: int = 1024
    voice_bytes_total: int = 1024 * 1024 * 1024

    def __post_init__(self) -> None:
        _require_above_zero(
            self,
            (
                "requests_per_s",
                "header_timeout_s",
                "body_timeout_s",
                "ws_idle_timeout_s",
                "context_idle_timeout_s",
            ),
        )
        _require_at_least_one(
            self,
            (
                "request_burst",
                "connections_per_client",
                "queued_sentences",
                "pending_offers_per_client",
                "voices_per_client",
                "voice_bytes_per_client",
                "voices_total",
                "voice_bytes_total",
            ),
        )


@dataclass(frozen=True)
class ServiceConfig:
    """Everything the service needs to start.

    models_dir: a directory written by `scripts/build_engines.py` (manifest, checkpoints, voices/).
    voices_dir: where uploaded voices live; defaults to `models_dir/voices` next to `default`.
    max_streams: utterances synthesised at once; beyond that requests are refused as busy. With several
        token2wav workers each takes its share of them (a stream stays on its worker).
    max_text_chars: longest text of one request (HTTP input, one websocket context's buffer).
    max_voice_upload_s / max_voice_upload_bytes: limits on a reference clip for `POST /v1/voices`.
    device: a torch device (`cpu`, `cuda`, `cuda:1`) for every engine, or `auto`: every visible GPU,
        spread as `placement` says (the CPU when there is none).
    placement: with several GPUs, `disaggregated` (one LLM engine on the first GPU, a token2wav worker on
        every GPU) or `replicated` (an LLM engine and a token2wav worker on every GPU); see placement.py.
    llm_devices / token2wav_devices: explicit devices of the LLM engines and of the token2wav workers
        (each its own thread, CUDA stream, graphs and voice caches); they override `device`.
    llm_backend: `tensorrt_llm`, `torch`, or `auto`: TensorRT-LLM when its engine was built into the
        models directory and can run here, PyTorch otherwise (engines/llm/auto.py).
    token2wav_backend: `tensorrt`, `torch`, or `auto`: TensorRT when the DiT plans were built and can run
        here, PyTorch otherwise (engines/token2wav/auto.py).
    dit_cache_rule: the DiT flow's streaming estimator cache: `reference` (Step-Audio2's trim and noise
        offset) or `prompt_recent` (prompt + 100 newest frames per stream: less memory; docs/fidelity.md).
    vocoder_precision: HiFT's decoder's: `float32` as the reference, or `float16` / `bfloat16` (faster
        convolutions, not the reference's audio: docs/fidelity.md; engines/token2wav/hift.py).
    llm_slots: requests the LLM decodes together (None: `max_streams`; 1 serves one at a time).
    token2wav_batch: most chunks a token2wav worker thread runs in one call (64: a burst of new streams'
        first chunks in one call); the solve memory cap below splits calls of long-cached chunks.
    token2wav_solve_gib: the most GiB one batched DiT solve may need (engines/token2wav/solve_memory.py:
        its buffers and working tensors by padded shape): batches of chunks with long caches (the
        reference DiT cache rule keeps L_p + 100 frames per stream) get fewer rows, first chunks keep
        `token2wav_batch`. 16 GiB: above the ~14 GiB of the largest 64-row solve under `prompt_recent`,
        which fit an 80 GB H100 beside 320 streams, below the ~25 GiB of the 32-row ones the reference
        rule fit beside 128 (docs/benchmarks.md); None: no cap.
    token2wav_memory_gib: the device bytes (GiB) each token2wav worker's streams may reserve: a stream is
        admitted only while its bound (engines/token2wav/stream_memory.py) fits, else refused `busy`.
        None: on CUDA, what is free after the warm-up less `token2wav_memory_margin_gib` (shared out
        among the workers of one device); on the CPU, no byte limit.
    token2wav_memory_margin_gib: what the measured budget leaves free for fragmentation and the working
        memory of batches outside the CUDA graphs' pools. 8 GiB: the OOM at 128 streams on an H100 left
        7 GiB reserved but unusable for a 126 MiB block (fragmentation), plus ~1 GiB for eager encoder,
        vocoder and LLM prefill tensors. Kept since `serve` runs the allocator with expandable segments
        (engines/cuda_memory.py), which fragments far less: not re-measured at the edge.
    first_chunk_tokens: speech tokens in a stream's first chunk under the exponential schedule (its
        3 lookahead tokens come on top; MIN_FIRST_CHUNK_TOKENS..MAX_FIRST_CHUNK_TOKENS). Fewer: first
        audio sooner (fewer LLM decode steps before it, a shorter first token2wav call) and less of it
        (2 mel frames a token less the 8 that HiFT holds back: 440 ms of audio at 15, 240 ms at 10), so the
        second chunk is due sooner. 15, the reference's, by default; the token2wav graphs and the offline
        render follow it. Whether fewer tokens sound as good needs the released weights.
    light_load_first_chunk_tokens, light_load_streams: a stream that starts while fewer than
        `light_load_streams` streams are open on its token2wav worker gets a first chunk of
        `light_load_first_chunk_tokens` instead (`schedule.FirstChunkByLoad`; both first chunks' graphs
        are captured at start-up). Off (0) by default: on an H200 with 16, first audio of a lone stream
        came 2 ms sooner and of 16-stream bursts 9 ms sooner, but bursts of 64 came 50 ms later (their
        first chunks in two calls) and the largest burst without underrun fell from 126 to 96
        (docs/benchmarks.md, thirty-seventh session).
    first_chunk_hold: how long a first chunk waits for the first chunks of other new streams to share
        its token2wav call (realtime/batch_policy.py).
    urgent_chunk_calls: a later chunk due within this many recent token2wav calls goes before waiting
        first chunks (0: first chunks always go first; realtime/batch_policy.py).
    llm_prefill_padding: the PyTorch LLM's `prefill_padding_limit`: padded positions a prefill call may
        compute for rows beyond its prompts before it leaves prompts for the next step (None: no limit).
    llm_programmatic_launch: the PyTorch LLM's `programmatic_launch` (its decode kernels launched with
        programmatic dependent launch on Hopper or later, at steps of at most 16 rows).
    token2wav_call_tokens: the most speech tokens one token2wav call takes (None: up to
        `token2wav_batch` chunks whatever their size). A call is not interrupted, so this bounds how
        long an urgent chunk waits (realtime/batch_policy.py). Off by default: on an H100, 1600 (64
        second chunks, ~160 ms) cut the bursts' underruns at 79 and 95 streams but raised them at 128
        (docs/benchmarks.md, eighth session).
    final_chunk_graphs: vocode final chunks (whatever a segment leaves: any length) from CUDA graphs,
        padded to length buckets (engines/token2wav/graphs.py); off, eagerly at their own lengths, which
        saves ~100 captures at start-up but costs ~10 ms of host time per call (~70 ms for a new length).
    warmup_between_calls: the service is ready once the token2wav warm-up's first stage is done (every
        chunk of the largest batch, first chunks at every batch size); its other ~200 CUDA graph captures
        run as steps between calls (engines/token2wav/torch_warmup.py; ~20 s less to ready on an H100,
        docs/benchmarks.md twentieth session). Off: ready only once all of it is done.
    render_hop: offline synthesis (`realtime synth`) hands each utterance's tokens to token2wav in chunks
        as the LLM decodes them (the last chunk whatever is left), so token2wav works while the LLM is
        still decoding and a long text never needs one solve over all its frames: chunks of this many
        tokens, or with None the exponential schedule's (15, 25, 50, 100, 200, ...: the shapes the
        warm-up captures, whatever `schedule` is; docs/benchmarks.md, thirteenth session).
    token2wav_workers: token2wav threads (each on its own CUDA stream); a stream stays on the thread
        that opened it. More than one turns the PyTorch backend's CUDA graphs off.
    chunk_queue: chunks (per stream) synthesised ahead of a slow consumer before the stream waits.
    llm_pacing: streams ask the LLM for their next chunk's tokens only (`TokenStream.want`), which leaves
        the GPU to token2wav instead of decoding seconds ahead of playback; off, every request decodes
        to its end at once (the benchmark's baseline, as CosyVoice's runtime does).
    drain_timeout_s: how long shutdown waits for running streams before cancelling them.
    gil_switch_s: `sys.setswitchinterval` for the `serve` process: how long a thread that wants the GIL
        waits before the thread holding it must let go (the event loop, the LLM thread and the token2wav
        thread share it). Python's 5 ms; 0.5 ms made 16 and 64 streams slower on an H100 (docs/benchmarks.md).
    voice_sync_s: how often the voices directory is re-read for voices other replicas sharing it added
        or deleted (a voice is also loaded on its first use, and a deleted one forgotten at its next).
    retry_after_s: the Retry-After a busy answer suggests.
    webrtc: the WebRTC transport's limits and ICE policy (`WebRTCConfig`).
    voice_aliases: voice names of other APIs (OpenAI's `alloy`, ...) → our voice ids, used where no
        voice of that name exists (`realtime/voice_aliases.py`; default: every OpenAI name → `default`).
    access: API keys and allowed web origins (`AccessConfig`).
    limits: per-client rate, connection, idle-time, queue and voice limits (`LimitsConfig`).
    """

    models_dir: Path
    host: str = "127.0.0.1"
    port: int = 8080
    voices_dir: Path | None = None
    flow: FlowKind = "dit"
    llm_backend: LLMBackend = "auto"
    token2wav_backend: Token2WavBackend = "auto"
    dit_cache_rule: CacheRule = "reference"
    vocoder_precision: VocoderPrecision = "float32"
    device: str = "auto"
    placement: PlacementKind = PlacementKind.DISAGGREGATED
    llm_devices: tuple[str, ...] | None = None
    token2wav_devices: tuple[str, ...] | None = None
    schedule: ScheduleKind = ScheduleKind.EXPONENTIAL
    first_chunk_tokens: int = ExponentialHops.first
    light_load_first_chunk_tokens: int = FirstChunkByLoad.light_tokens
    light_load_streams: int = FirstChunkByLoad.light_streams
    max_streams: int = 16
    max_text_chars: int = 4096
    max_voice_upload_s: float = 30.0
    max_voice_upload_bytes: int = 16 * 1024 * 1024
    max_contexts_per_socket: int = 8
    llm_slots: int | None = None
    token2wav_batch: int = 64
    token2wav_solve_gib: float | None = 16.0
    token2wav_memory_gib: float | None = None
    token2wav_memory_margin_gib: float = 8.0
    first_chunk_hold: FirstChunkHold = field(default_factory=FirstChunkHold)
    token2wav_call_tokens: int | None = None
    llm_prefill_padding: int | None = None
    llm_programmatic_launch: bool = True
    urgent_chunk_calls: float = 2.0
    final_chunk_graphs: bool = True
    warmup_between_calls: bool = True
    render_hop: int | None = None
    token2wav_workers: int = 1
    chunk_queue: int = 4
    llm_pacing: bool = True
    drain_timeout_s: float = 10.0
    gil_switch_s: float = 0.005
    voice_sync_s: float = 2.0
    retry_after_s: int = 1
    webrtc: WebRTCConfig = field(default_factory=WebRTCConfig)
    voice_aliases: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_VOICE_ALIASES))
    access: AccessConfig = field(default_factory=AccessConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models_dir", Path(self.models_dir))
        if self.voices_dir is not None:
            object.__setattr__(self, "voices_dir", Path(self.voices_dir))
        if self.flow not in ("dit", "unet"):
            raise ValueError(f"flow must be 'dit' or 'unet', got {self.flow!r}")
        for name, choices in (("llm_backend", LLMBackend), ("token2wav_backend", Token2WavBackend),
                              ("vocoder_precision", VocoderPrecision)):
            if getattr(self, name) not in get_args(choices):
                raise ValueError(f"{name} must be one of {get_args(choices)}, got {getattr(self, name)!r}")
        if self.dit_cache_rule not in CACHE_RULES:
            raise ValueError(f"dit_cache_rule must be one of {CACHE_RULES}, got {self.dit_cache_rule!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        _require_at_least_one(
            self,
            (
                "max_streams",
                "max_text_chars",
                "max_voice_upload_bytes",
                "max_contexts_per_socket",
                "token2wav_batch",
                "token2wav_workers",
                "chunk_queue",
                "retry_after_s",
            ),
        )
        object.__setattr__(self, "placement", PlacementKind(self.placement))
        DevicePlan(self.llm_devices or ("cpu",), self.token2wav_devices or ("cpu",))  # refuses an empty list
        if self.token2wav_solve_gib is not None and not self.token2wav_solve_gib > 0:
            raise ValueError(f"token2wav_solve_gib must be > 0, got {self.token2wav_solve_gib}")
        if self.token2wav_memory_gib is not None and not self.token2wav_memory_gib > 0:
            raise ValueError(f"token2wav_memory_gib must be > 0, got {self.token2wav_memory_gib}")
        if not self.token2wav_memory_margin_gib >= 0:
            raise ValueError(f"token2wav_memory_margin_gib must be >= 0, "
                             f"got {self.token2wav_memory_margin_gib}")
        for name in ("first_chunk_tokens", "light_load_first_chunk_tokens"):
            if not MIN_FIRST_CHUNK_TOKENS <= getattr(self, name) <= MAX_FIRST_CHUNK_TOKENS:
                raise ValueError(f"{name} must be in {MIN_FIRST_CHUNK_TOKENS}..{MAX_FIRST_CHUNK_TOKENS}, "
                                 f"got {getattr(self, name)}")
        if self.light_load_streams < 0:
            raise ValueError(f"light_load_streams must be >= 0, got {self.light_load_streams}")
        if self.render_hop is not None and self.render_hop < 1:
            raise ValueError(f"render_hop must be >= 1 or None, got {self.render_hop}")
        if self.llm_slots is not None and self.llm_slots < 1:
            raise ValueError(f"llm_slots must be >= 1, got {self.llm_slots}")
        if not self.voice_sync_s > 0:
            raise ValueError(f"voice_sync_s must be > 0, got {self.voice_sync_s}")
        if not self.drain_timeout_s > 0:
            raise ValueError(f"drain_timeout_s must be > 0, got {self.drain_timeout_s}")
        if self.llm_prefill_padding is not None and self.llm_prefill_padding < 0:
            raise ValueError(f"llm_prefill_padding must be 0 or more, got {self.llm_prefill_padding}")
        if not 0 < self.gil_switch_s <= 1:
            raise ValueError(f"gil_switch_s must be in (0, 1] seconds, got {self.gil_switch_s}")
        # The speech tokenizer reads at most 30 s in one call.
        if not 1.0 < self.max_voice_upload_s <= 30.0:
            raise ValueError(f"max_voice_upload_s must be in (1, 30], got {self.max_voice_upload_s}")

    @property
    def device_plan(self) -> DevicePlan:
        """The devices of the LLM engines and token2wav workers (`auto` resolved against the GPUs)."""
        import torch

        gpus = torch.cuda.device_count() if self.device == "auto" and torch.cuda.is_available() else 0
        return plan_devices(self.device, gpus, self.placement, self.llm_devices, self.token2wav_devices)

    @property
    def first_chunk_rule(self) -> FirstChunkByLoad:
        """The exponential schedule's first hop by load (`first_chunk_tokens`, `light_load_*`); never the
        light-load one under another schedule, whose policy chooses its own first hop."""
        light = self.light_load_streams if self.schedule is ScheduleKind.EXPONENTIAL else 0
        return FirstChunkByLoad(self.first_chunk_tokens, self.light_load_first_chunk_tokens, light)

    @property
    def token2wav_solve_bytes(self) -> int | None:
        return None if self.token2wav_solve_gib is None else int(self.token2wav_solve_gib * GIB)

    @property
    def token2wav_memory_bytes(self) -> int | None:
        return None if self.token2wav_memory_gib is None else int(self.token2wav_memory_gib * GIB)

    @property
    def token2wav_memory_margin_bytes(self) -> int:
        return int(self.token2wav_memory_margin_gib * GIB)

    @property
    def voice_store(self) -> Path:
        return self.voices_dir if self.voices_dir is not None else self.models_dir / "voices"

    def replace(self, **changes: object) -> ServiceConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
