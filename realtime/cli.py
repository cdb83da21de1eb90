"""`realtime serve`: run the service; `realtime synth`: speak one text into a WAV file (no server)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from realtime.config import DEFAULT_CACHE_DIR, IceServer, ServiceConfig, WebRTCConfig
from realtime.schedule import ScheduleKind

logger = logging.getLogger("realtime")


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


def _config(args: argparse.Namespace) -> ServiceConfig:
    webrtc = WebRTCConfig(
        max_sessions=args.max_streams,
        host_addresses=tuple(args.advertise_address) if args.advertise_address else None,
        ice_servers=tuple(_ice_server(spec) for spec in args.ice_server),
    )
    models = Path(args.models) if args.models else default_models_dir()
    return ServiceConfig(
        models_dir=models,
        host=args.host,
        port=args.port,
        voices_dir=Path(args.voices) if args.voices else None,
        flow=args.flow,
        device=args.device,
        schedule=ScheduleKind(args.schedule),
        max_streams=args.max_streams,
        drain_timeout_s=args.drain_timeout,
        webrtc=webrtc,
    )


def serve(config: ServiceConfig) -> int:
    """Run uvicorn until SIGINT/SIGTERM; running streams get `drain_timeout_s` to finish."""
    import uvicorn

    from realtime.app import create_app

    server_config = uvicorn.Config(
        create_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop" if sys.platform != "win32" else "asyncio",
        ws="websockets",
        ws_max_size=1 << 20,
        timeout_graceful_shutdown=int(config.drain_timeout_s) + 1,
        log_level="info",
    )
    uvicorn.Server(server_config).run()
    return 0


async def synth(config: ServiceConfig, text: str, voice: str, out: Path) -> int:
    """Speak `text` with the engines in this process and write a 24 kHz WAV."""
    import numpy as np
    import soundfile

    from realtime.runtime import Runtime
    from realtime.session import SpeechRequest

    runtime = Runtime(config)
    await runtime.start()
    try:
        async with runtime.speak(SpeechRequest(text=text, voice=voice)) as session:
            pieces = [chunk.pcm async for chunk in session]
    finally:
        await runtime.stop(config.drain_timeout_s)
    audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
    soundfile.write(out, audio, 24000, subtype="PCM_16")
    logger.info("wrote %s (%.2f s)", out, audio.size / 24000)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="realtime", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("serve", "run the HTTP/websocket/WebRTC server"),
                            ("synth", "speak one text into a WAV file")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--models", help="models directory (default: tiny synthetic models, built once into "
                                          f"{DEFAULT_CACHE_DIR})")
        sub.add_argument("--voices", help="directory of uploaded voices (default: MODELS/voices)")
        sub.add_argument("--flow", choices=("dit", "unet"), default="dit", help="token2wav flow")
        sub.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
        sub.add_argument("--schedule", choices=[k.value for k in ScheduleKind], default="exponential",
                         help="chunk schedule")
        sub.add_argument("--max-streams", type=int, default=16, help="concurrent utterances before 'busy'")
        sub.add_argument("--drain-timeout", type=float, default=10.0,
                         help="seconds running streams get to finish at shutdown")
        sub.add_argument("--advertise-address", action="append", default=[],
                         help="WebRTC: IP address to advertise as a host candidate (repeatable; default: all)")
        sub.add_argument("--ice-server", action="append", default=[],
                         help="WebRTC: STUN/TURN server, URL or URL,USERNAME,CREDENTIAL (repeatable)")
        sub.add_argument("--host", default="127.0.0.1")
        sub.add_argument("--port", type=int, default=8080)
        if name == "synth":
            sub.add_argument("text")
            sub.add_argument("--voice", default="default")
            sub.add_argument("--out", type=Path, default=Path("speech.wav"))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = _config(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"realtime: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve":
        return serve(config)
    return asyncio.run(synth(config, args.text, args.voice, args.out))
