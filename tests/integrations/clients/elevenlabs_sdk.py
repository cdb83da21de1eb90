"""ElevenLabs' Python SDK against the server: convert, stream, the timestamped routes and the realtime
websocket (`convert_realtime`), pointed at it by `base_url` alone.

`convert_realtime` always connects with `wss://` (it swaps the base URL's scheme), so that mode talks to
a TLS front of the server (`--https-url`) whose certificate `--ca` names; the rest use `--http-url`.
"""

from __future__ import annotations

import argparse
import base64
import os

from common import TURN, llm_tokens, report
from elevenlabs.client import ElevenLabs

MODEL = "eleven_flash_v2_5"
TEXT = "Hello there. How are you today?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-url", required=True)
    parser.add_argument("--https-url")
    parser.add_argument("--ca", help="the TLS front's certificate (PEM)")
    parser.add_argument("--mode", choices=("convert", "stream", "timestamps", "realtime"), required=True)
    parser.add_argument("--output-format", default=None)
    parser.add_argument("--voice", default="default")
    parser.add_argument("--api-key", default="unused", help="the key the client is configured with")
    args = parser.parse_args()
    fmt = {"output_format": args.output_format} if args.output_format else {}
    if args.mode == "realtime":
        os.environ["SSL_CERT_FILE"] = args.ca  # trust the TLS front, as one trusts a deployment's CA
        client = ElevenLabs(api_key=args.api_key, base_url=args.https_url)
        audio = b"".join(
            client.text_to_speech.convert_realtime(args.voice, text=llm_tokens(TURN), model_id=MODEL, **fmt)
        )
        report(audio_b64=base64.b64encode(audio).decode("ascii"))
        return
    client = ElevenLabs(api_key=args.api_key, base_url=args.http_url)
    tts = client.text_to_speech
    if args.mode == "convert":
        audio = b"".join(tts.convert(args.voice, text=TEXT, model_id=MODEL, **fmt))
        report(audio_b64=base64.b64encode(audio).decode("ascii"))
    elif args.mode == "stream":
        audio = b"".join(tts.stream(args.voice, text=TEXT, model_id=MODEL, **fmt))
        report(audio_b64=base64.b64encode(audio).decode("ascii"))
    else:
        whole = tts.convert_with_timestamps(args.voice, text=TEXT, model_id=MODEL, **fmt)
        chunks = list(tts.stream_with_timestamps(args.voice, text=TEXT, model_id=MODEL, **fmt))
        streamed_chars = [c for chunk in chunks if chunk.alignment for c in chunk.alignment.characters]
        report(
            audio_b64=base64.b64encode(base64.b64decode(whole.audio_base_64)).decode("ascii"),
            chars="".join(whole.alignment.characters),
            starts=whole.alignment.character_start_times_seconds,
            ends=whole.alignment.character_end_times_seconds,
            streamed_chars="".join(streamed_chars),
            streamed_audio_bytes=sum(len(base64.b64decode(c.audio_base_64)) for c in chunks),
        )


if __name__ == "__main__":
    main()
