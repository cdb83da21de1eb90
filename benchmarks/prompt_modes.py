"""First-chunk latency of each prompt mode through the runtime (no sockets), one request at a time.

    python benchmarks/prompt_modes.py --size tiny --device cpu
    python benchmarks/prompt_modes.py --models /path/to/models --device cuda --requests 50

For every mode the same text is spoken `--requests` times (fixed length: random weights never stop on
their own) and the time from `Runtime.speak` to the first chunk of audio is measured. `instruct2
(repeated)` repeats one instruction (its prompt comes from the cache after the first request);
`instruct2 (new)` sends a different instruction each time (tokenized at admission). The prompt column
is the LLM prompt's length in positions. Prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.build.synthetic import build_random  # noqa: E402
from engines.llm.base import LLMRequest, SamplingParams  # noqa: E402
from engines.llm.model import prompt_length  # noqa: E402
from realtime.config import ServiceConfig  # noqa: E402
from realtime.runtime import Runtime  # noqa: E402
from realtime.session import SpeechRequest  # noqa: E402

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
INSTRUCTION = "Speak slowly, in a calm and warm voice, like telling a bedtime story."


def cases(requests: int) -> dict[str, list[SpeechRequest]]:
    sampling = SamplingParams(seed=1, fixed_length=60)
    return {
        "zero_shot": [SpeechRequest(TEXT, sampling=sampling) for _ in range(requests)],
        "cross_lingual": [SpeechRequest(TEXT, sampling=sampling, language="zh") for _ in range(requests)],
        "instruct2 (repeated)": [SpeechRequest(TEXT, sampling=sampling, instructions=INSTRUCTION)
                                 for _ in range(requests)],
        "instruct2 (new)": [SpeechRequest(TEXT, sampling=sampling, instructions=f"{INSTRUCTION} Take {i}.")
                            for i in range(requests)],
    }


async def first_chunk_s(runtime: Runtime, request: SpeechRequest) -> float:
    started = time.perf_counter()
    session = runtime.speak(request)
    try:
        async for chunk in session:
            if chunk.pcm.size:
                return time.perf_counter() - started
    finally:
        await session.aclose()
    raise RuntimeError("the session produced no audio")


async def run(models: Path, device: str, requests: int) -> None:
    with tempfile.TemporaryDirectory() as voices:
        runtime = Runtime(ServiceConfig(models_dir=models, voices_dir=Path(voices), device=device))
        await runtime.start()
        prompts: list[LLMRequest] = []
        for engine in runtime._engines.llms:  # type: ignore[union-attr]
            submit = engine.submit

            def recording(request: LLMRequest, submit=submit):  # type: ignore[no-untyped-def]
                prompts.append(request)
                return submit(request)

            engine.submit = recording  # type: ignore[method-assign]
        try:
            await first_chunk_s(runtime, SpeechRequest(TEXT, sampling=SamplingParams(fixed_length=30)))
            print(f"{requests} requests per mode, one at a time, on {device}")
            print("| mode | prompt positions | first chunk p50 ms | p90 ms | mean ms |")
            print("|---|---|---|---|---|")
            for name, speech in cases(requests).items():
                times = sorted([await first_chunk_s(runtime, request) for request in speech])
                last = prompts[-1]
                positions = prompt_length(len(last.prompt_text_ids) + len(last.text_ids),
                                          len(last.prompt_speech_tokens))
                p90 = times[min(len(times) - 1, int(0.9 * len(times)))]
                print(f"| {name} | {positions} | {1000 * statistics.median(times):.1f} | {1000 * p90:.1f} | "
                      f"{1000 * statistics.fmean(times):.1f} |")
        finally:
            await runtime.stop(drain_timeout_s=5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, help="a models directory (default: build synthetic ones)")
    parser.add_argument("--size", choices=("tiny", "full"), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()
    if args.models is not None:
        asyncio.run(run(args.models, args.device, args.requests))
        return
    with tempfile.TemporaryDirectory() as scratch:
        models = build_random(Path(scratch) / args.size, args.size)
        asyncio.run(run(models, args.device, args.requests))


if __name__ == "__main__":
    main()
