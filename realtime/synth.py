"""`realtime synth`: offline synthesis of many texts into files, batched, through the service's runtime.

A JSON Lines file holds one item per line, `{"text": ..., "voice": ..., "out": ...}` (`voice` defaults
to `default`; a relative `out` is relative to the file; optional `instructions` and `language` choose
the mode as in the APIs). Items run concurrently (at most twice the
LLM's slots at a time, so its batch stays full while finished items wait for token2wav); each one is a
`Runtime.render`: its LLM requests run to the end and token2wav renders each as one final chunk, the
worker running up to `token2wav_batch` of them per `run_chunks` call. The output format follows the
file extension.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from engines.config import SAMPLE_RATE
from engines.llm.base import SamplingParams
from realtime.audio import encode_pcm_s16le, make_stream_encoder, wav_header
from realtime.bench_metrics import ServerFigures, parse_samples
from realtime.config import ServiceConfig
from realtime.runtime import Runtime
from realtime.session import ServiceError

# File extension → `make_stream_encoder` format (WAV is written with its real sizes instead).
FORMATS = {".wav": "wav", ".flac": "flac", ".mp3": "mp3", ".ogg": "opus", ".opus": "opus"}


@dataclass(frozen=True)
class SynthItem:
    """One text to speak into one file."""

    text: str
    out: Path
    voice: str = "default"
    instructions: str | None = None
    language: str | None = None

    def __post_init__(self) -> None:
        if self.out.suffix.lower() not in FORMATS:
            raise ValueError(f"cannot write {self.out}: the extension must be one of {sorted(FORMATS)}")


def read_jsonl(path: Path) -> list[SynthItem]:
    """The items of a JSON Lines file (blank lines skipped); ValueError names the bad line."""
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            out = Path(entry["out"])
            style = {name: entry.get(name) for name in ("instructions", "language")}
            if any(value is not None and not isinstance(value, str) for value in style.values()):
                raise TypeError("instructions and language must be strings")
            items.append(SynthItem(str(entry["text"]), path.parent / out, str(entry.get("voice", "default")),
                                   **style))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}:{number}: expected {{\"text\", \"out\"[, \"voice\", \"instructions\", "
                             f"\"language\"]}}: {exc}") from exc
    if not items:
        raise ValueError(f"{path} holds no items")
    return items


def encode_file(pcm: np.ndarray, suffix: str) -> bytes:
    """24 kHz float32 audio as the bytes of a file of the format `suffix` names."""
    kind = FORMATS[suffix.lower()]
    if kind == "wav":
        samples = encode_pcm_s16le(pcm)
        return wav_header(SAMPLE_RATE, len(samples)) + samples
    encoder = make_stream_encoder(kind)
    return encoder.encode(pcm) + encoder.finish()


@dataclass(frozen=True)
class SynthReport:
    """What one run produced: wall time counts synthesis and writing, not loading the engines."""

    items: int
    audio_s: float
    wall_s: float
    work: ServerFigures  # what the engines did meanwhile (LLM steps, token2wav calls)

    @property
    def real_time_factor(self) -> float:
        """Wall seconds per second of audio (below 1: faster than real time)."""
        return self.wall_s / self.audio_s if self.audio_s > 0 else float("nan")

    def table(self) -> str:
        head = f"{'items':>6} {'audio s':>9} {'wall s':>8} {'RTF':>7}"
        row = f"{self.items:>6} {self.audio_s:>9.2f} {self.wall_s:>8.2f} {self.real_time_factor:>7.3f}"
        w = self.work
        llm_s = w.llm_steps * w.llm_step_ms / 1000
        token2wav_s = w.token2wav_batches * w.token2wav_batch_ms / 1000
        engines = (f"LLM: {w.llm_steps} steps of {w.llm_step_ms:.2f} ms ({llm_s:.2f} s); token2wav: "
                   f"{w.token2wav_batches} calls of {w.token2wav_chunks_per_batch:.1f} chunks, "
                   f"{w.token2wav_batch_ms:.1f} ms each ({token2wav_s:.2f} s)")
        return f"{head}\n{row}\n{engines}"


async def synthesize(runtime: Runtime, items: Sequence[SynthItem], sampling: SamplingParams,
                     progress: bool = False) -> SynthReport:
    """Speak every item with a started `runtime` and write its file. The first item that fails stops the
    run: its ServiceError is raised. `progress`: a bar of the items written on standard error."""
    in_flight = asyncio.Semaphore(2 * (runtime.config.llm_slots or runtime.config.max_streams))
    bar = tqdm(total=len(items), desc="synth", unit="item", disable=not progress)

    async def speak(item: SynthItem) -> float:
        async with in_flight:
            pcm = await runtime.render(item.text, item.voice, sampling, item.instructions, item.language)
        data = await asyncio.to_thread(encode_file, pcm, item.out.suffix)
        item.out.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(item.out.write_bytes, data)
        bar.update()
        return pcm.size / SAMPLE_RATE

    before = parse_samples(runtime.metrics.render().decode())
    started = time.perf_counter()
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(speak(item)) for item in items]
    except* ServiceError as failed:  # the others were cancelled
        raise failed.exceptions[0] from None
    finally:
        bar.close()
    wall_s = time.perf_counter() - started
    work = ServerFigures.between(before, parse_samples(runtime.metrics.render().decode()))
    return SynthReport(len(items), sum(task.result() for task in tasks), wall_s, work)


def run(config: ServiceConfig, items: Sequence[SynthItem], sampling: SamplingParams,
        progress: bool = False) -> SynthReport:
    """Load the engines of `config`, synthesise `items` (`progress`: with a bar of the items written),
    and stop."""

    async def main() -> SynthReport:
        # Offline, `token2wav_batch` utterances run at once (no admission): size the engines for them.
        runtime = Runtime(config.replace(max_streams=max(config.max_streams, config.token2wav_batch)))
        await runtime.start()
        try:
            return await synthesize(runtime, items, sampling, progress)
        finally:
            await runtime.stop(config.drain_timeout_s)

    return asyncio.run(main())
