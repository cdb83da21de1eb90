"""`realtime serve`: run the service; `realtime synth`: speak a text, or a JSON Lines file of texts, into
audio files (no server, batched; realtime/synth.py);
`realtime bench`: load-test a server over the agents' websocket (realtime/bench.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

from engines.cuda_memory import use_expandable_segments
from engines.llm.auto import LLMBackend
from engines.token2wav.auto import Token2WavBackend
from engines.token2wav.dit_cache import CACHE_RULES
from realtime.access import KEYS_ENV, read_keys
from realtime.batch_policy import FirstChunkHold
from realtime.config import (
    DEFAULT_CACHE_DIR,
    MAX_FIRST_CHUNK_TOKENS,
    MIN_FIRST_CHUNK_TOKENS,
    AccessConfig,
    IceServer,
    LimitsConfig,
    ServiceConfig,
    VocoderPrecision,
    WebRTCConfig,
)
from realtime.placement import PlacementKind, parse_devices
from realtime.schedule import ExponentialHops, ScheduleKind
from realtime.voice_aliases import DEFAULT_VOICE_ALIASES, parse_alias

logger = logging.getLogger("realtime")
BASELINE_TOKEN2WAV_WORKERS = 4


def default_models_dir(size: str = "tiny") -> Path:
    """The synthetic models the service falls back to, built once into the cache directory."""
    from engines.build.synthetic import build_random

    return build_random(DEFAULT_CACHE_DIR / size, size)  # type: ignore[arg-type]


def _ice_server(spec: str) -> IceServer:
    """`URL` or `URL,USERNAME,CREDENTIAL` (TURN)."""
    url, *auth = spec.split(",")
    if len(auth) not in (0, 2):
        raise ValueError(f"--ice-server takes URL or URL,USERNAME,CREDENTIAL, got {spec!r}")
    return IceServer(url, *auth)


def _levels(spec: str) -> tuple[int, ...]:
    try:
        return tuple(int(n) for n in spec.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {spec!r}") from None


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _first_chunk_tokens(text: str) -> int:
    value = int(text)
    if not MIN_FIRST_CHUNK_TOKENS <= value <= MAX_FIRST_CHUNK_TOKENS:
        raise argparse.ArgumentTypeError(
            f"must be {MIN_FIRST_CHUNK_TOKENS} to {MAX_FIRST_CHUNK_TOKENS} tokens, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of 0 or more, got {text}")
    return value


def _devices(spec: str) -> tuple[str, ...]:
    try:
        return parse_devices(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _voice_alias(text: str) -> tuple[str, str]:
    try:
        return parse_alias(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fractions(spec: str) -> tuple[float, ...]:
    try:
        return tuple(float(f) for f in spec.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {spec!r}") from None


def _config(args: argparse.Namespace) -> ServiceConfig:
    webrtc = WebRTCConfig(
        max_sessions=args.max_streams,
        connect_timeout_s=getattr(args, "webrtc_connect_timeout", WebRTCConfig.connect_timeout_s),
        host_addresses=tuple(args.advertise_address) if args.advertise_address else None,
        ice_servers=tuple(_ice_server(spec) for spec in args.ice_server),
    )
    models = Path(args.models) if args.models else default_models_dir()
    access, limits = _access_and_limits(args)
    return ServiceConfig(
        models_dir=models,
        host=args.host,
        port=args.port,
        voices_dir=Path(args.voices) if args.voices else None,
        flow=args.flow,
        llm_backend=args.llm_backend,
        token2wav_backend=args.token2wav_backend,
        dit_cache_rule=args.dit_cache_rule,
        vocoder_precision=args.vocoder_precision,
        device=args.device,
        placement=PlacementKind(args.placement),
        llm_devices=args.llm_device,
        token2wav_devices=args.token2wav_devices,
        schedule=ScheduleKind(args.schedule),
        first_chunk_tokens=args.first_chunk_tokens,
        light_load_first_chunk_tokens=args.light_load_first_chunk_tokens,
        light_load_streams=0 if args.baseline else args.light_load_streams,
        max_streams=args.max_streams,
        drain_timeout_s=args.drain_timeout,
        gil_switch_s=getattr(args, "gil_switch_ms", ServiceConfig.gil_switch_s * 1000) / 1000,
        voice_sync_s=args.voice_sync,
        # The baseline the benchmark compares against (the design we replace): no batching across
        # requests, one LLM request at a time and batch-1 token2wav on a small pool of threads.
        llm_slots=1 if args.baseline else None,
        token2wav_batch=1 if args.baseline else args.batch,
        token2wav_solve_gib=args.token2wav_solve_gib or None,
        token2wav_memory_gib=args.token2wav_memory_gib or None,
        token2wav_memory_margin_gib=args.token2wav_memory_margin_gib,
        first_chunk_hold=FirstChunkHold(args.first_chunk_gap_ms / 1000, args.first_chunk_hold_ms / 1000),
        token2wav_call_tokens=args.token2wav_call_tokens or None,
        llm_prefill_padding=args.llm_prefill_padding,
        llm_programmatic_launch=args.llm_programmatic_launch,
        render_hop=getattr(args, "render_hop", 0) or None,
        final_chunk_graphs=args.final_chunk_graphs,
        warmup_between_calls=args.warm_up_between_calls,
        urgent_chunk_calls=args.urgent_chunk_calls,
        token2wav_workers=BASELINE_TOKEN2WAV_WORKERS if args.baseline else 1,
        llm_pacing=not args.baseline,
        webrtc=webrtc,
        voice_aliases={**DEFAULT_VOICE_ALIASES, **dict(args.voice_alias)},
        access=access,
        limits=limits,
        **{name: getattr(args, name) for _, name, _, _ in _SERVICE_LIMIT_FLAGS if hasattr(args, name)},
    )


# `serve` flags of LimitsConfig fields: (flag, field, type, help).
_LIMIT_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--rate-limit", "requests_per_s", float, "requests (HTTP, websockets, offers) per s per client"),
    ("--rate-burst", "request_burst", int, "requests a client may make at once before the rate applies"),
    ("--max-connections-per-client", "connections_per_client", int, "websockets + HTTP requests at once"),
    ("--header-timeout", "header_timeout_s", float, "seconds a client has to send request headers"),
    ("--body-timeout", "body_timeout_s", float, "seconds a request body may stall between pieces"),
    ("--ws-idle-timeout", "ws_idle_timeout_s", float, "close websockets silent and not speaking this long"),
    ("--context-idle-timeout", "context_idle_timeout_s", float,
     "end a context holding unspoken text (no flush/end) with no input this long"),
    ("--max-queued-sentences", "queued_sentences", int, "texts queued for speaking per context"),
    ("--max-pending-offers", "pending_offers_per_client", int, "unconnected WebRTC sessions per client"),
    ("--max-voices-per-client", "voices_per_client", int, "uploaded voices per client"),
    ("--max-voice-bytes-per-client", "voice_bytes_per_client", int, "bytes of uploaded voices per client"),
    ("--max-voices", "voices_total", int, "uploaded voices in all"),
    ("--max-voice-bytes", "voice_bytes_total", int, "bytes of uploaded voices in all"),
)


# `serve` flags of ServiceConfig's own limits: (flag, field, type, help).
_SERVICE_LIMIT_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    ("--max-text-chars", "max_text_chars", int, "longest text of a request or a context's buffer"),
    ("--max-contexts-per-socket", "max_contexts_per_socket", int, "contexts open at once on one websocket"),
    ("--max-voice-upload-seconds", "max_voice_upload_s", float, "longest reference clip (decoding stops)"),
    ("--max-voice-upload-bytes", "max_voice_upload_bytes", int, "largest reference clip upload"),
)


def _access_and_limits(args: argparse.Namespace) -> tuple[AccessConfig, LimitsConfig]:
    if args.command != "serve":
        return AccessConfig(), LimitsConfig()
    keys = read_keys(args.api_key, Path(args.api_keys_file) if args.api_keys_file else None)
    limits = LimitsConfig(**{name: getattr(args, name) for _, name, _, _ in _LIMIT_FLAGS})
    return AccessConfig(api_keys=keys, cors_origins=tuple(args.cors_origin)), limits


def _add_access_flags(sub: argparse.ArgumentParser) -> None:
    defaults = LimitsConfig()
    sub.add_argument(
        "--api-key",
        action="append",
        default=[],
        help=f"accepted API key (repeatable; also --api-keys-file and ${KEYS_ENV}); none: open to all",
    )
    sub.add_argument("--api-keys-file", help="file of accepted API keys, one per line")
    sub.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        help="web origin besides the service's own that browsers may call it from (repeatable; '*': any)",
    )
    sub.add_argument(
        "--webrtc-connect-timeout",
        type=float,
        default=WebRTCConfig.connect_timeout_s,
        help="close a WebRTC session not connected this long after its answer (default: %(default)s)",
    )
    service_defaults = {f.name: f.default for f in dataclasses.fields(ServiceConfig)}
    for flag, name, kind, help_text in _SERVICE_LIMIT_FLAGS:
        help_text = f"{help_text} (default: %(default)s)"
        sub.add_argument(flag, dest=name, type=kind, default=service_defaults[name], help=help_text)
    for flag, name, kind, help_text in _LIMIT_FLAGS:
        default = getattr(defaults, name)
        help_text = f"{help_text} (default: %(default)s)"
        sub.add_argument(flag, dest=name, type=kind, default=default, help=help_text)


def preflight(config: ServiceConfig) -> None:
    """What would make the start fail after seconds of loading, checked first: the models directory
    and the devices. ValueError/FileNotFoundError with one sentence."""
    import torch

    from engines.config import read_manifest

    if not config.models_dir.is_dir():
        raise FileNotFoundError(f"--models: {config.models_dir} is not a directory")
    read_manifest(config.models_dir)
    plan = config.device_plan
    for device in {*plan.llm_devices, *plan.token2wav_devices}:
        if not device.startswith("cuda"):
            continue
        if not torch.cuda.is_available():
            build = "has no CUDA" if torch.version.cuda is None else "sees no GPU"
            raise ValueError(f"device {device!r}: PyTorch {torch.__version__} {build}; try --device cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} GPU(s) are visible")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to host:port (before any engine loads, so a taken port fails at once)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def _configure_allocator() -> None:
    """Expandable segments for the CUDA allocator (engines/cuda_memory.py), before the engines allocate."""
    kept = use_expandable_segments()
    logging.getLogger(__name__).info(
        "CUDA allocator: %s", f"as {kept} sets it" if kept else "expandable segments (memory freed returns)")


def serve(config: ServiceConfig) -> int:
    """Run the server until SIGTERM/SIGINT, then drain: running streams get `drain_timeout_s` to finish
    (realtime.app.DrainingServer); exit 0 after a clean drain."""
    from realtime.bytecode import keep_bytecode

    # Before the first import of torch (realtime.app's): a restart then reads its compiled modules.
    bytecode = keep_bytecode(config.models_dir / "compile-cache" / "bytecode")
    if bytecode is not None:
        logging.getLogger(__name__).info("Python bytecode cached in %s", bytecode)
    from realtime.app import DrainingServer, create_app, server_config

    try:
        preflight(config)
        sock = listen(config.host, config.port)
    except (OSError, ValueError) as exc:
        print(f"realtime serve: {exc}", file=sys.stderr)
        return 2
    _configure_allocator()
    sys.setswitchinterval(config.gil_switch_s)
    app = create_app(config)
    uvicorn_config = server_config(app, config, host=config.host, port=config.port, log_level="info")
    server = DrainingServer(uvicorn_config, app.state.drain, config.drain_timeout_s)
    with sock:
        server.run(sockets=[sock])
    return 0 if server.started else 1


def synth(config: ServiceConfig, args: argparse.Namespace) -> int:
    """Speak `args.text` into `args.out`, or every item of `args.jsonl`, and print the totals."""
    from engines.llm.base import SamplingParams
    from realtime.session import ServiceError
    from realtime.synth import SynthItem, read_jsonl, run

    try:
        if args.jsonl is not None:
            items = read_jsonl(args.jsonl)
        else:
            items = [SynthItem(args.text, args.out, args.voice)]
        sampling = SamplingParams(seed=args.seed, fixed_length=args.fixed_length)
        preflight(config)
    except (OSError, ValueError) as exc:
        print(f"realtime synth: {exc}", file=sys.stderr)
        return 2
    _configure_allocator()
    try:
        report = run(config, items, sampling, progress=sys.stderr.isatty())
    except ServiceError as exc:
        print(f"realtime synth: {exc.code}: {exc}", file=sys.stderr)
        return 1
    print(report.table())
    return 0


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The options only `serve` has (network, WebRTC, drain, warm-up)."""
    parser.add_argument(
        "--warm-up-between-calls",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ready once the token2wav warm-up's first stage is done (first chunks at every batch size); "
             "the rest of its CUDA graphs are captured between calls. Off: ready once all are",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        help="seconds running streams get to finish at shutdown",
    )
    parser.add_argument(
        "--gil-switch-ms",
        type=float,
        default=ServiceConfig.gil_switch_s * 1000,
        help="Python's GIL switch interval for this process (Python's own: 5): how long the event loop "
             "may wait for the GIL while an engine thread runs Python (default: %(default)s)",
    )
    parser.add_argument(
        "--voice-sync",
        type=float,
        default=2.0,
        help="seconds between re-reads of the voices directory, for replicas sharing it",
    )
    parser.add_argument(
        "--advertise-address",
        action="append",
        default=[],
        help="WebRTC: IP address to advertise as a host candidate (repeatable; default: all)",
    )
    parser.add_argument(
        "--ice-server",
        action="append",
        default=[],
        help="WebRTC: STUN/TURN server, URL or URL,USERNAME,CREDENTIAL (repeatable)",
    )
    parser.add_argument(
        "--voice-alias",
        type=_voice_alias,
        action="append",
        default=[],
        metavar="NAME=VOICE",
        help="speak VOICE for requests naming NAME when no voice NAME exists (repeatable; by default "
        "every OpenAI voice name speaks 'default')",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on")
    parser.add_argument(
        "--baseline",
        action="store_true",
        help="benchmark baseline: one LLM request at a time, batch-1 token2wav on "
        f"{BASELINE_TOKEN2WAV_WORKERS} threads",
    )


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help that shows each option's default where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = "default" in text or not action.option_strings
        if shown or action.default in (None, False, [], (), argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="realtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (
        ("serve", "run the HTTP/websocket/WebRTC server"),
        ("synth", "speak a text or a JSON Lines file of texts into audio files"),
    ):
        sub = commands.add_parser(name, help=help_text, formatter_class=_HelpWithDefaults)
        sub.add_argument(
            "--models",
            help=f"models directory (default: tiny synthetic models, built once into {DEFAULT_CACHE_DIR})",
        )
        sub.add_argument("--voices", help="directory of uploaded voices (default: MODELS/voices)")
        sub.add_argument("--flow", choices=("dit", "unet"), default="dit", help="token2wav flow")
        sub.add_argument(
            "--llm-backend",
            choices=get_args(LLMBackend),
            default="auto",
            help="LLM engine (auto: TensorRT-LLM when built and runnable here, else PyTorch)",
        )
        sub.add_argument(
            "--token2wav-backend",
            choices=get_args(Token2WavBackend),
            default="auto",
            help="token2wav backend (auto: TensorRT when its plans are built and runnable, else PyTorch)",
        )
        sub.add_argument(
            "--dit-cache-rule",
            choices=CACHE_RULES,
            default="reference",
            help="DiT streaming cache: reference (Step-Audio2's trim and noise offset) or prompt_recent "
                 "(prompt + 100 newest frames: less memory per stream; see docs/fidelity.md)",
        )
        sub.add_argument(
            "--vocoder-precision",
            choices=get_args(VocoderPrecision),
            default="float32",
            help="HiFT decoder's precision: float32 (the reference) or float16/bfloat16 (faster "
                 "convolutions, not the reference's audio; see docs/fidelity.md)",
        )
        sub.add_argument("--device", default="auto",
                         help="torch device of every engine (cpu, cuda, cuda:1, ...), or auto: every visible "
                              "GPU, spread as --placement says")
        sub.add_argument("--placement", choices=[k.value for k in PlacementKind], default="disaggregated",
                         help="with several GPUs: one LLM engine and a token2wav worker per GPU "
                              "(disaggregated), or both engines on every GPU (replicated)")
        sub.add_argument("--llm-device", type=_devices, metavar="DEVICES",
                         help="LLM engine device(s), e.g. cuda:0 (overrides --device)")
        sub.add_argument("--token2wav-devices", type=_devices, metavar="DEVICES",
                         help="one token2wav worker per device, e.g. cuda:1,cuda:2 (overrides --device)")
        sub.add_argument(
            "--schedule",
            choices=[k.value for k in ScheduleKind],
            default="exponential",
            help="chunk schedule",
        )
        sub.add_argument(
            "--first-chunk-tokens", type=_first_chunk_tokens, default=ExponentialHops.first, metavar="N",
            help="speech tokens in a stream's first chunk under the exponential schedule "
                 f"({MIN_FIRST_CHUNK_TOKENS}..{MAX_FIRST_CHUNK_TOKENS}; fewer: first audio sooner and "
                 "shorter, the second chunk due sooner; default: the reference's)",
        )
        sub.add_argument(
            "--light-load-first-chunk-tokens", type=_first_chunk_tokens,
            default=ServiceConfig.light_load_first_chunk_tokens, metavar="N",
            help="the first chunk's speech tokens for a stream that starts while fewer than "
                 "--light-load-streams are open on its token2wav worker (first audio sooner while the GPU "
                 "has room for the second chunk that comes due sooner)",
        )
        sub.add_argument(
            "--light-load-streams", type=_non_negative_int, default=ServiceConfig.light_load_streams,
            metavar="K",
            help="open streams below which a new stream gets the light-load first chunk (default 0: off)",
        )
        sub.add_argument("--max-streams", type=int, default=16, help="concurrent utterances before 'busy'")
        sub.add_argument(
            "--batch", type=int, default=64, help="most chunks per token2wav call (synth: utterances)"
        )
        sub.add_argument("--token2wav-solve-gib", type=float, default=16.0,
                         help="most GiB one batched DiT solve may take: chunks with long caches get fewer "
                              "rows per batch (0: no cap)")
        sub.add_argument("--token2wav-memory-gib", type=float, default=0.0,
                         help="GiB of device memory each token2wav worker's streams may reserve; a stream "
                              "whose bound does not fit is refused 'busy' (0: on CUDA what is free after "
                              "the warm-up less the margin, on the CPU no limit)")
        sub.add_argument("--token2wav-memory-margin-gib", type=float, default=8.0,
                         help="GiB the measured token2wav memory budget leaves free for fragmentation and "
                              "working memory")
        sub.add_argument("--first-chunk-gap-ms", type=float, default=FirstChunkHold().gap_s * 1000,
                         help="a first chunk waits for other new streams' first chunks while one came within "
                              "this many ms (or 1.5 recent LLM decode steps if longer)")
        sub.add_argument("--first-chunk-hold-ms", type=float, default=FirstChunkHold().max_s * 1000,
                         help="and at most this many ms in all (0: no waiting)")
        sub.add_argument("--urgent-chunk-calls", type=_non_negative_float,
                         default=ServiceConfig.urgent_chunk_calls,
                         help="a later chunk due within this many recent token2wav calls goes before "
                              "new streams' first chunks (0: first chunks always first)")
        sub.add_argument("--token2wav-call-tokens", type=_non_negative_int, default=0,
                         help="the most speech tokens one token2wav call takes, so that an urgent chunk "
                              "never waits long behind a call (0: no limit beyond --batch chunks)")
        sub.add_argument("--llm-prefill-padding", type=_non_negative_int, default=None, metavar="POSITIONS",
                         help="PyTorch LLM: padded positions a prefill call may compute for rows beyond its "
                              "prompts; past it the rest wait for the next step (default: no limit)")
        sub.add_argument("--llm-programmatic-launch", action=argparse.BooleanOptionalAction, default=True,
                         help="PyTorch LLM on Hopper or later: launch the decode kernels of steps of at most "
                              "16 rows with programmatic dependent launch")
        sub.add_argument("--final-chunk-graphs", action=argparse.BooleanOptionalAction, default=True,
                         help="vocode final chunks of any length from CUDA graphs padded to length buckets "
                              "(~100 more captures at start-up); off: eagerly at their own lengths")
        if name == "serve":
            _add_serve_flags(sub)
            _add_access_flags(sub)
        else:  # the serve-only settings `_config` reads, at their defaults
            serve_only = argparse.ArgumentParser(add_help=False)
            _add_serve_flags(serve_only)
            sub.set_defaults(**vars(serve_only.parse_args([])))
            sub.set_defaults(warm_up_between_calls=False)  # no idle time to fill: all of it first
        if name == "synth":
            source = sub.add_mutually_exclusive_group(required=True)
            source.add_argument("text", nargs="?", help="one text to speak into --out")
            source.add_argument(
                "--jsonl", type=Path, help='JSON Lines of {"text", "voice", "out"} (.wav, .flac, .mp3, .ogg)'
            )
            sub.add_argument("--render-hop", type=_non_negative_int, default=0,
                             help="speech tokens per token2wav chunk while rendering (the last: the rest; "
                                  "0: the exponential schedule's chunks)")
            sub.add_argument("--voice", default="default", help="voice of TEXT")
            sub.add_argument("--out", type=Path, default=Path("speech.wav"), help="output file of TEXT")
            sub.add_argument(
                "--fixed-length", type=int, help="benchmarks: exactly this many speech tokens per LLM request"
            )
            sub.add_argument("--seed", type=int, help="sampling seed (default: random)")
    bench = commands.add_parser(
        "bench", help="load-test a server over the agents' websocket", formatter_class=_HelpWithDefaults
    )
    bench.add_argument("--url", help="websocket URL of a running server (default: spawn one)")
    bench.add_argument("--models", type=Path, help="models directory for the spawned server")
    bench.add_argument(
        "--streams", type=_levels, default=(1, 4, 16, 64, 128), help="comma-separated concurrency levels"
    )
    bench.add_argument("--tokens", type=int, default=250, help="speech tokens per request")
    bench.add_argument("--tokens-spread", type=float, default=0.0,
                       help="each request's tokens uniform within ± this fraction of --tokens (seeded per "
                            "stream), so utterances and their final chunks come in many lengths")
    bench.add_argument("--voice", default="default")
    bench.add_argument(
        "--server-arg", action="append", default=[], help="extra `serve` argument (repeatable)"
    )
    bench.add_argument("--no-baseline", action="store_true", help="skip the baseline server")
    bench.add_argument("--no-search", action="store_true", help="skip the max-concurrency search")
    bench.add_argument("--search-max", type=int, default=320,
                       help="upper end of the capacity search (serve's --max-streams must reach it)")
    bench.add_argument("--search-repeats", type=int, default=1,
                       help="bursts in a row a count must pass without underrun in the search")
    bench.add_argument("--baseline-streams", type=_levels, help="the baseline's levels (default: --streams)")
    bench.add_argument("--staggered", type=_fractions, default=(),
                       help="Poisson-arrival loads as fractions of the burst capacity, e.g. 0.5,0.8,1")
    bench.add_argument("--staggered-s", type=float, default=30.0, help="seconds of arrivals per load")
    bench.add_argument("--capacity", type=int, help="the capacity --staggered refers to (default: searched)")
    bench.add_argument("--json", type=Path, default=Path("bench-results/bench.json"))
    paced = bench.add_argument_group("token-paced turns (realtime/bench_tokens.py)")
    paced.add_argument("--token-paced", action="store_true",
                       help="measure first audio after the first sentence's last token of an LLM-paced turn")
    paced.add_argument("--clients",
                       default="native,cartesia,cartesia-sentences,elevenlabs,elevenlabs-sentences,elevenlabs-livekit",
                       help="comma-separated client shapes to drive")
    paced.add_argument("--turns", type=int, default=5, help="turns per client")
    paced.add_argument("--token-interval-ms", type=float, default=30.0, help="time between LLM tokens")
    return parser


def bench(args: argparse.Namespace) -> int:
    from realtime.bench import BenchOptions, run
    from realtime.bench_server import spawned_server

    if args.token_paced:
        return token_paced(args, spawned_server)

    try:
        options = BenchOptions(
            streams=args.streams,
            tokens=args.tokens,
            tokens_spread=args.tokens_spread,
            voice=args.voice,
            url=args.url,
            models=args.models,
            server_args=tuple(args.server_arg),
            baseline=not args.no_baseline,
            search=not args.no_search,
            search_max=args.search_max,
            search_repeats=args.search_repeats,
            baseline_streams=args.baseline_streams,
            staggered=args.staggered,
            staggered_s=args.staggered_s,
            capacity=args.capacity,
            json_path=args.json,
        )
    except ValueError as exc:  # a bad option: said as serve's are, not as a traceback
        print(f"realtime bench: {exc}", file=sys.stderr)
        return 2
    return run(options)


def token_paced(args: argparse.Namespace, spawned_server: Callable[..., Any]) -> int:
    from urllib.parse import urlsplit

    from realtime import bench_tokens

    def table(url: str) -> str:
        parts = urlsplit(url)
        return bench_tokens.run(
            f"ws://{parts.netloc}", args.clients.split(","), args.turns, args.token_interval_ms / 1000
        )

    if args.url:
        print(table(args.url))
    else:
        with spawned_server(args.models, tuple(args.server_arg)) as url:
            print(table(url))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "bench":
        return bench(args)
    try:
        config = _config(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"realtime: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(config)
    return synth(config, args)
