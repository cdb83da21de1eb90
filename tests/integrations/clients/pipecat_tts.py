"""Pipecat's TTS services against the server, in a pipeline as an agent runs them: an LLM turn's text
frames arrive token by token between LLMFullResponseStart/End frames, the pipeline asks for its output
sample rate, and what comes out (audio, word-timed text, errors) is collected at both ends.

Modes: `cartesia` (CartesiaTTSService, websocket, its default sentence aggregation), `cartesia-http`
(CartesiaHttpTTSService, POST /tts/bytes), `openai` (OpenAITTSService with its defaults).
"""

from __future__ import annotations

import asyncio

from common import parse_args, report
from pipecat.processors.frame_processor import FrameProcessor
from pipecat_turn import speak_turn

# Pipecat ends a turn that stays silent for 3 s; the tiny model on a busy 2-core CI machine can take that
# long to start, so the tests allow more (an agent would tune it the same way for a slow provider).
STOP_FRAME_TIMEOUT_S = 30.0


def make_service(mode: str, http_url: str, voice: str, api_key: str) -> FrameProcessor:
    if mode == "cartesia":
        from pipecat.services.cartesia.tts import CartesiaTTSService

        return CartesiaTTSService(
            api_key=api_key,
            url=f"{http_url.replace('http', 'ws', 1)}/cartesia/tts/websocket",
            settings=CartesiaTTSService.Settings(voice=voice),
            stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S,
        )
    if mode == "cartesia-http":
        from pipecat.services.cartesia.tts import CartesiaHttpTTSService

        return CartesiaHttpTTSService(
            api_key=api_key,
            base_url=f"{http_url}/cartesia",
            settings=CartesiaHttpTTSService.Settings(voice=voice),
            stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S,
        )
    from pipecat.services.openai.tts import OpenAITTSService

    return OpenAITTSService(
        api_key=api_key, base_url=f"{http_url}/v1", stop_frame_timeout_s=STOP_FRAME_TIMEOUT_S
    )


async def main() -> None:
    args = parse_args("cartesia", "cartesia-http", "openai")
    rate = args.sample_rate or 24000
    tts = make_service(args.mode, args.http_url, args.voice, args.api_key)
    turn = await speak_turn(
        tts,
        sample_rate=rate,
        interrupt=args.interrupt,
        token_gap_s=0.03,
        audio_timeout_s=180,
        stopped_timeout_s=180,
        after_interrupt_s=0.5,
        after_stopped_s=0.3,
        stop_on_error=True,
    )
    last_sentence_token_at = next((at for token, at in turn.queued_at if token.endswith("today.")), 0.0)
    first_audio_at = turn.downstream.first_audio_at
    report(
        **turn.result(),
        first_audio_after_first_sentence_s=(
            first_audio_at - last_sentence_token_at if first_audio_at else None
        ),
    )


if __name__ == "__main__":
    asyncio.run(main())
