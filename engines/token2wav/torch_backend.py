"""Token2Wav in PyTorch: any `FlowModel` (DiT or UNet) followed by the HiFT vocoder.

Each stream pairs the flow's stream (its caches) with a `HiFTStream` (mel/source cache and cross-fade,
MODEL_FACTS §5.6); a chunk runs the flow on its tokens and vocodes the mel it returns. The flow runs in
the requested dtype (fp16 on CUDA by default, as the reference), HiFT in fp32 (its decoder in a half
precision if asked: `vocoder_dtype`, not the reference's numerics). After its last chunk a stream frees
its tensors.

`launch_chunks` batches: the DiT flow solves all the chunks as padded batches (flow_dit.DiTFlow.chunks,
from CUDA graphs on CUDA) and HiFT vocodes equal-shaped chunks together (hift_stream.launch_vocode_streams,
from CUDA graphs for the chunk lengths of `graph_hops`); only the audio's copy to the host is waited
for, by the caller, when it wants the audio. `warmup` captures the usual shapes before traffic.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from engines.config import STEADY_HOP, TOKEN_MEL_RATIO, HiFTConfig, ModelPaths, configs_for_models_dir
from engines.exclusive import EXCLUSIVE
from engines.token2wav.base import (
    ChunkJob,
    LaunchedChunks,
    SpeakerState,
    Token2Wav,
    Token2WavStream,
    WarmupSteps,
)
from engines.token2wav.batching import Buckets
from engines.token2wav.block_compile import BlockCompileWorkers, idle_workers_for_cold_start
from engines.token2wav.dit_cache import CacheRule
from engines.token2wav.flow_base import FlowModel, FlowSpeaker, FlowStream
from engines.token2wav.flow_dit import DiTFlow, DiTSpeaker, FlowLaunch, load_dit_flow
from engines.token2wav.hift import HiFTGenerator, load_hift
from engines.token2wav.hift_stream import HiFTStream, launch_vocode_streams
from engines.token2wav.stream_memory import stream_state_bytes
from engines.token2wav.torch_warmup import Phases, staged_warmup
from engines.token2wav.vocoder_graphs import FINAL_CHUNK_FRAMES, GraphedVocoder
from engines.token2wav.warmup_shapes import reserve_graphs, start_compiling_blocks
from engines.voice import VoicePrompt

logger = logging.getLogger(__name__)

FlowVariant = Literal["dit", "unet"]
GRAPH_HOPS = (15, 25, 50, 100)  # the exponential schedule's hops before the 200-token ones
WARMUP_BATCHES = (64, 32, 16, 8, 4, 2, 1)
# Flow graphs from two rows up: one row is a shape class of its own for the compiled DiT blocks (a dim of
# size 1 specialises), which cost ~29 s of a cold and ~14 s of a warm start on an H100 to compile and
# capture, while a lone chunk's solve is launch-bound at one row or two.
FLOW_GRAPH_BATCHES = (2, 4, 8, 16, 32, 64)
# HiFT graphs up to the largest token2wav batch: eagerly, a 64-row HiFT call launches ~1000 kernels
# from Python, which under load costs more than its GPU time. Their shared pool holds a few GiB.
VOCODER_GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64)


def vocoder_graph_chunks(cfg: HiFTConfig, hops: Sequence[int],
                         extra_first_hops: Sequence[int] = ()) -> list[tuple[int, int]]:
    """HiFT's (mel frames, cached source samples) for chunks of `hops` tokens: first chunks without a
    cache, later ones after the cached frames; and first chunks of `extra_first_hops` tokens."""
    frames = [TOKEN_MEL_RATIO * hop for hop in hops]
    firsts = [TOKEN_MEL_RATIO * hop for hop in extra_first_hops if hop not in hops]
    return ([(f, 0) for f in frames] + [(f + cfg.mel_cache_frames, cfg.source_cache_samples) for f in frames]
            + [(f, 0) for f in dict.fromkeys(firsts)])


def schedule_hops(graph_hops: Sequence[int]) -> tuple[int, ...]:
    """The hops the warm-up runs streams through: the schedule's graphed ones, then one steady hop (a
    final chunk of the lookahead follows)."""
    return (*graph_hops, STEADY_HOP)


def flow_graph_buckets(buckets: Buckets, graph_hops: Sequence[int],
                       extra_first_hops: Sequence[int] = ()) -> Buckets:
    """`buckets` for the flow's graphs when chunks are `graph_hops` tokens, or a first chunk is one of
    `extra_first_hops`: their frames (and the steady hop's) as chunk buckets, so no chunk of the schedule
    is padded, and a first chunk's frames rounded up to 16 as a later call's own-cache bucket (32 after
    the default 30-frame first chunk, and after a 20-frame one). With the default hops these are the
    defaults."""
    firsts = (graph_hops[0], *extra_first_hops)
    frames = ({TOKEN_MEL_RATIO * hop for hop in (*schedule_hops(graph_hops), *extra_first_hops)}
              | {buckets.frames[-1]})
    first_owns = {-(-TOKEN_MEL_RATIO * hop // 16) * 16 for hop in firsts}
    own = first_owns | {bucket for bucket in buckets.own_frames if bucket > min(first_owns)}
    return dataclasses.replace(buckets, batch=FLOW_GRAPH_BATCHES, frames=tuple(sorted(frames)),
                               own_frames=tuple(sorted(own)))


def other_first_hops(graph_hops: Sequence[int], extra_first_hops: Sequence[int]) -> tuple[int, ...]:
    """`extra_first_hops` without `graph_hops`' own first hop, each once."""
    return tuple(hop for hop in dict.fromkeys(extra_first_hops) if hop != graph_hops[0])


def compile_worker_count(graph_hops: Sequence[int], extra_first_hops: Sequence[int] = ()) -> int:
    """A cold start's DiT block compile workers: one per chunk the warm-up's streams run (`schedule_hops`
    and the final one, and the first chunks of `extra_first_hops`) and attention layout (two:
    warmup_shapes.compile_job_shapes) where the cores allow, else one per chunk (the split's lists are
    then merged back)."""
    chunks = len(schedule_hops(graph_hops)) + 1 + len(extra_first_hops)
    return 2 * chunks if 2 * chunks <= len(os.sched_getaffinity(0)) else chunks


@dataclass(frozen=True, eq=False)
class TorchSpeaker(SpeakerState):
    """The flow's per-voice state (HiFT needs none)."""

    flow: FlowSpeaker

    @property
    def nbytes(self) -> int:
        return self.flow.nbytes


class TorchStream(Token2WavStream):
    """One utterance: the flow's stream and the vocoder's stream."""

    def __init__(self, flow: FlowStream, vocoder: HiFTStream) -> None:
        self.flow = flow
        self.vocoder = vocoder

    @property
    def nbytes(self) -> int:
        return self.flow.nbytes + self.vocoder.nbytes

    def close(self) -> None:
        self.flow.close()
        self.vocoder.close()


class TorchToken2Wav(Token2Wav):
    """`flow` and `hift` on the same device; `vocoder_seed` fixes HiFT's noise (None: fresh per stream).

    cuda_graphs: on CUDA, solve batched DiT chunks with CUDA graphs, and vocode chunks of `graph_hops`
    tokens (first chunks, and later ones with HiFT's cached frames), first chunks of `extra_first_hops`
    tokens (a schedule whose first hop is one of them) and final chunks of any length
    (padded to length buckets, masked) from CUDA graphs; graphs are captured on the first use of a
    shape, or ahead by `warmup`. final_chunk_graphs off: final chunks run eagerly at their own lengths.
    precompiled: where the compiled DiT block is kept for later processes (engines/precompiled.py; None:
    compiled anew in each, through torch.compile). block_workers: idle compile workers spawned for a cold
    start (`from_models_dir`), handed their shapes by `prepare_warmup` or `warmup`. flow_buckets: the
    DiT flow graphs' shape buckets (None: the flow's own, at `FLOW_GRAPH_BATCHES` rows).
    """

    def __init__(self, flow: FlowModel, hift: HiFTGenerator, name: str = "torch",
                 vocoder_seed: int | None = None, cuda_graphs: bool = True,
                 graph_hops: Sequence[int] = GRAPH_HOPS, final_chunk_graphs: bool = True,
                 precompiled: Path | None = None, block_workers: BlockCompileWorkers | None = None,
                 flow_buckets: Buckets | None = None, extra_first_hops: Sequence[int] = ()) -> None:
        self.flow = flow.eval()
        self.hift = hift.eval()
        self.name = name
        self.vocoder_seed = vocoder_seed
        self.graph_hops = tuple(graph_hops)
        self.extra_first_hops = other_first_hops(graph_hops, extra_first_hops)
        self.vocoder_graphs: GraphedVocoder | None = None
        self._idle_workers = block_workers  # spawned, no shapes yet
        self._block_workers: BlockCompileWorkers | None = None  # from `prepare_warmup`, until `warmup`
        if cuda_graphs and self.device.type == "cuda":
            if isinstance(flow, DiTFlow) and flow.batches_streams:
                buckets = dataclasses.replace(flow.buckets, batch=FLOW_GRAPH_BATCHES)
                flow.enable_cuda_graphs(buckets if flow_buckets is None else flow_buckets, precompiled)
            chunks = vocoder_graph_chunks(hift.cfg, self.graph_hops, self.extra_first_hops)
            self.vocoder_graphs = GraphedVocoder(self.hift, chunks,
                                                 VOCODER_GRAPH_BATCHES,
                                                 FINAL_CHUNK_FRAMES if final_chunk_graphs else ())

    @staticmethod
    def from_models_dir(
        models_dir: Path,
        variant: FlowVariant,
        device: torch.device | str,
        dtype: torch.dtype | None = None,
        cuda_graphs: bool = True,
        dit_cache_rule: CacheRule = "reference",
        solve_memory_bytes: int | None = None,
        final_chunk_graphs: bool = True,
        precompiled: Path | None = None,
        preload_compile_workers: bool = True,
        vocoder_dtype: torch.dtype = torch.float32,
        graph_hops: Sequence[int] = GRAPH_HOPS,
        extra_first_hops: Sequence[int] = (),
    ) -> TorchToken2Wav:
        """Load the `variant` flow of a models directory with its HiFT (Step-Audio2's for the DiT flow,
        CosyVoice2's for the UNet flow); the architecture comes from the directory's manifest.

        dtype: the flow's (None: fp16 on CUDA as the reference runs it, fp32 elsewhere); HiFT is fp32.
        cuda_graphs: as for the constructor. dit_cache_rule: the DiT flow's (dit_cache.py).
        solve_memory_bytes: the DiT flow's cap on one batched solve (solve_memory.py; None: none).
        final_chunk_graphs, precompiled: as for the constructor (`precompiled` on CUDA only).
        preload_compile_workers: a cold start's compile workers build their models on the device while
        they wait for their shapes (block_compile.py); off where that memory must stay free until the
        LLM has built (realtime/warm_up.py).
        vocoder_dtype: HiFT's decoder's (`HiFTGenerator.use_decoder_dtype`); float32 as the reference.
        graph_hops, extra_first_hops: as for the constructor; the DiT flow graphs' chunk buckets follow
            them (`flow_graph_buckets`: the defaults for the default hops).
        """
        if dtype is None:
            dtype = torch.float16 if torch.device(device).type == "cuda" else torch.float32
        extra_first_hops = other_first_hops(graph_hops, extra_first_hops)
        paths = ModelPaths(Path(models_dir))
        configs = configs_for_models_dir(paths.root)
        flow: FlowModel
        workers = None
        if variant == "dit":
            flow_cfg = dataclasses.replace(configs.dit_flow, att_cache_rule=dit_cache_rule)
            if cuda_graphs:  # a cold start's compile workers import while the models load
                workers = idle_workers_for_cold_start(precompiled, flow_cfg, dtype, torch.device(device),
                                                      compile_worker_count(graph_hops, extra_first_hops),
                                                      preload=preload_compile_workers)
            try:
                flow = load_dit_flow(paths.dit_flow, flow_cfg, device, dtype)
                flow.limit_solve_memory(solve_memory_bytes)
                hift = load_hift(paths.hift, configs.hift, device, vocoder_dtype)
            except BaseException:
                if workers is not None:
                    workers.stop()
                raise
        elif variant == "unet":
            # Imported here: the UNet flow is optional for DiT deployments.
            from engines.token2wav.flow_unet import load_unet_flow

            flow = load_unet_flow(paths.unet_flow, configs.unet_flow, device, dtype)
            hift = load_hift(paths.cosyvoice2_hift, configs.hift, device, vocoder_dtype)
        else:
            raise ValueError(f"unknown flow variant {variant!r}; expected 'dit' or 'unet'")
        buckets = (flow_graph_buckets(flow.buckets, graph_hops, extra_first_hops)
                   if isinstance(flow, DiTFlow) else None)
        return TorchToken2Wav(flow, hift, name=f"torch-{variant}", cuda_graphs=cuda_graphs,
                              graph_hops=graph_hops, final_chunk_graphs=final_chunk_graphs,
                              precompiled=precompiled, block_workers=workers, flow_buckets=buckets,
                              extra_first_hops=extra_first_hops)

    @property
    def device(self) -> torch.device:
        return self.flow.device

    def prepare_speaker(self, voice: VoicePrompt) -> TorchSpeaker:
        # At a start it runs the modules beside an LLM build, which may trace (engines/exclusive.py).
        with EXCLUSIVE:
            return TorchSpeaker(self.flow.prepare_speaker(voice))

    def open_stream(self, speaker: SpeakerState) -> TorchStream:
        if not isinstance(speaker, TorchSpeaker):
            raise TypeError(f"{self.name} needs a TorchSpeaker, got {type(speaker).__name__}")
        return TorchStream(self.flow.open_stream(speaker.flow), HiFTStream(self.hift, seed=self.vocoder_seed))

    def stream_bytes_bound(self, speaker: SpeakerState, max_tokens: int) -> int | None:
        """The DiT flow's bound (stream_memory.py); None for the UNet flow."""
        flow, voice = self.flow, _dit_speaker(speaker)
        if not isinstance(flow, DiTFlow) or voice is None:
            return None
        return stream_state_bytes(flow.cfg, self.hift.cfg, flow.dtype.itemsize, voice.prompt_frames,
                                  max_tokens)

    def run_chunk(self, job: ChunkJob) -> torch.Tensor:
        return self.launch_chunks([job]).wait()[0]

    def run_chunks(self, jobs: Sequence[ChunkJob]) -> list[torch.Tensor]:
        """Chunks of distinct streams, batched (see the module docstring); audio in the jobs' order."""
        return self.launch_chunks(jobs).wait()

    def launch_chunks(self, jobs: Sequence[ChunkJob]) -> LaunchedChunks:
        """`run_chunks` without waiting for the device: nothing in a call waits for it but the audio's
        copy to the host, which `wait()` does."""
        streams = []
        for job in jobs:
            if not isinstance(job.stream, TorchStream):
                raise TypeError(f"{self.name} needs a TorchStream, got {type(job.stream).__name__}")
            streams.append(job.stream)
        lasts = [job.last for job in jobs]
        flow = self.flow
        launch: FlowLaunch | None = None
        if isinstance(flow, DiTFlow) and flow.batches_streams:
            launch = flow.launch_chunks([s.flow for s in streams], [job.tokens for job in jobs], lasts)
            mels = launch.mels
        else:
            mels = [flow.chunk(s.flow, job.tokens, job.last) for s, job in zip(streams, jobs, strict=True)]
        try:
            audio = launch_vocode_streams([s.vocoder for s in streams], mels, lasts, self.vocoder_graphs)
            for stream, last in zip(streams, lasts, strict=True):
                if last:
                    stream.close()
        finally:
            if launch is not None:
                # After the vocoder's work and the audio's copy: the device runs these copies after them.
                launch.update_streams()
        return audio

    def warmup(self, speaker: SpeakerState, batches: Iterable[int] = WARMUP_BATCHES) -> None:
        """All of `staged_warmup` at once."""
        for _ in self.staged_warmup(speaker, batches):
            pass

    def staged_warmup(self, speaker: SpeakerState, batches: Iterable[int] = WARMUP_BATCHES) -> WarmupSteps:
        """For each batch size, that many streams of `speaker` run the chunks of `graph_hops` and one
        steady-state hop in step, then a final chunk (and first chunks of `extra_first_hops` tokens, in the
        first stage); then the solve, encoder and final-chunk vocoder graphs those passes do not meet but
        serving does are captured (torch_warmup.py). That compiles
        and captures the shapes the schedule produces (for voices with prompts up to this one's bucket)
        and runs every kernel once; with CUDA graphs, the first stage (until the first `yield`) does what
        new streams need at once, and each step after it a bounded piece of the rest.
        First the graphs' shared buffers are sized for every shape the warm-up will capture (so no graph
        is captured twice on a grown buffer). On a cold start (a kept DiT block with no variant saved
        yet) the block's shape classes these chunks meet are first compiled side by side in worker
        processes (block_compile.py; started earlier by `prepare_warmup`, or here).
        Once done no graph is captured: a shape the warm-up did not meet (a longer prompt, several voices
        in one batch) runs eagerly, logged, rather than stalling every stream for a capture."""
        hops = schedule_hops(self.graph_hops)
        batches = sorted(batches, reverse=True)
        phases = Phases(self.device)
        workers = self._block_workers
        self._block_workers = None
        if workers is None:
            workers = self._start_block_workers(speaker, batches)
        if workers is not None:
            workers.wait()
            phases.end("compile workers (the wait for them)")
        voice = _dit_speaker(speaker)
        if isinstance(self.flow, DiTFlow) and voice is not None:
            reserve_graphs(self.flow, batches, hops, voice, self.extra_first_hops)
        yield from staged_warmup(self, speaker, voice, batches, hops, phases)

    def release_warmup(self) -> None:
        """Stop the compile workers no warm-up took: idle ones spawned for a cold start, or ones
        `prepare_warmup` started for a warm-up that never came."""
        for workers in (self._idle_workers, self._block_workers):
            if workers is not None:
                workers.stop()
        self._idle_workers = self._block_workers = None

    def prepare_warmup(self, speaker: SpeakerState, batches: Iterable[int] = WARMUP_BATCHES) -> None:
        """On a cold start, start the worker processes that compile the DiT block's shape classes
        `warmup(speaker, the same batches)` will meet (block_compile.py), and return."""
        if self._block_workers is None:
            self._block_workers = self._start_block_workers(speaker, sorted(batches, reverse=True))

    def _start_block_workers(
        self, speaker: SpeakerState, batches: Iterable[int]
    ) -> BlockCompileWorkers | None:
        """A cold start's compile workers for the warm-up's chunk pass, the idle ones if spawned (None: none
        to start, or they could not start, logged: an optimisation, the warm-up compiles alone then)."""
        flow, idle, voice = self.flow, self._idle_workers, _dit_speaker(speaker)
        self._idle_workers = None
        if not isinstance(flow, DiTFlow) or flow.graphs is None or voice is None:
            if idle is not None:
                idle.stop()
            return None
        hops, prompt_frames = schedule_hops(self.graph_hops), voice.prompt_frames
        try:
            return start_compiling_blocks(flow, batches, hops, prompt_frames, idle, self.extra_first_hops)
        except Exception as exc:  # no processes on this host, say: compile in the warm-up as before
            if idle is not None:
                idle.stop()
            logger.warning("DiT block compile workers not started (%s: %s); the warm-up compiles alone",
                           type(exc).__name__, exc)
            return None

    @torch.inference_mode()
    def offline(self, speaker: SpeakerState, tokens: torch.Tensor) -> torch.Tensor:
        if not isinstance(speaker, TorchSpeaker):
            raise TypeError(f"{self.name} needs a TorchSpeaker, got {type(speaker).__name__}")
        if tokens.numel() == 0:
            return torch.zeros(0)
        mel = self.flow.offline(speaker.flow, tokens).float()
        generator = None if self.vocoder_seed is None else torch.Generator().manual_seed(self.vocoder_seed)
        speech, _ = self.hift(mel, generator=generator)
        return speech[0].float().cpu()


def _dit_speaker(speaker: SpeakerState) -> DiTSpeaker | None:
    """The DiT flow's state of `speaker` (None for another flow's, or another backend's speaker)."""
    if isinstance(speaker, TorchSpeaker) and isinstance(speaker.flow, DiTSpeaker):
        return speaker.flow
    return None
