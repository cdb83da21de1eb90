"""Step-Audio2 token → mel flow: conformer encoder + DiT flow matching, offline and streaming (§5).

Streaming keeps every cache instead of recomputing: per voice, `prepare_speaker` encodes the prompt once
(prompt tokens followed by their own first 3 tokens as stand-in lookahead, as the reference does) and
runs the 10 Euler steps over the prompt mel, keeping the encoder's and the estimator's caches. Streams
reference that prompt state read-only and hold only their own frames' caches, which each chunk extends.

Caches as the reference keeps them:
- estimator keys/values and noise columns: `dit_cache.EstimatorKeys` (the reference driver's trim to
  L_p + 100 frames and its noise offset by default; `FlowConfig.att_cache_rule` selects the option).
  A stream stores only its own kept frames (oldest first); the prompt frames it still attends to are
  read from the shared prompt state through an index (one chunk) or a per-row mask (batches).
- encoder keys/values: never trimmed, as in the reference. The relative-position table bounds prompt
  plus utterance to `max_relative_len / up_stride` tokens (2500 = 100 s at full size); the LLM's
  context (2048 positions, prompt included) keeps every utterance below it, and a longer one gets the
  table's ValueError, as the reference fails there too.

`chunks` runs the chunks of many streams as one padded batch (batching.py): one encoder pass, one
10-step solve whose DiT calls cover every stream and both guidance halves, the shared prompt caches held
once per voice and read by every row's attention next to its own cache (dit.SplitKeys). On CUDA the solve
replays a CUDA graph per bucketed shape (graphs.py). `launch_chunks` is `chunks` with the streams' cache
copies left to the caller (`FlowLaunch`), who queues them after the vocoder's work: they are not on the
way to the call's audio. `chunk` remains the one-stream path through the estimator's `forward_chunk`,
which exported estimators (TensorRT) implement.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engines.config import MEL_BINS, FlowConfig
from engines.token2wav.batching import (
    Buckets,
    EncodeShape,
    RowSpec,
    SolveShape,
    plan_batches,
    span_mask,
)
from engines.token2wav.cfm import ConditionalCFM, RaggedEstimator
from engines.token2wav.conformer import ConformerCache, blocks_attention_mask
from engines.token2wav.dit import DiT
from engines.token2wav.dit_cache import EstimatorKeys
from engines.token2wav.flow_base import ConformerFlow, FlowSpeaker, FlowStream
from engines.token2wav.graphs import (
    EagerEncoder,
    EagerSolver,
    EncoderInputs,
    EncoderLayout,
    EncoderRunner,
    GraphedEncoder,
    GraphedSolver,
    RaggedSolver,
    SolverLayout,
)
from engines.token2wav.solve_memory import SolveMemory
from engines.transfer import upload
from engines.voice import VoicePrompt
from engines.word_copies import cat_words_into_, clone_words, copy_words_

logger = logging.getLogger(__name__)

NOISE_FRAMES = 30000  # 600 s at 50 Hz, the reference's noise buffer
GUIDANCE_BATCH = 2  # conditional + unconditional rows of every estimator call


@dataclass(frozen=True, eq=False)
class DiTSpeaker(FlowSpeaker):
    """A voice's prompt state, shared read-only by its streams.

    tokens (N_p,); spks (1, 80) projected speaker vector; prompt_mel (1, 80, L_p = 2·N_p);
    encoder: the prompt's ConformerCache (batch 1); estimator_cnn (steps, depth, 2, 2·hidden, 2) and
    estimator_kv (steps, depth, 2, heads, L_p, 2·head_dim): DiT caches per Euler step, guidance batch;
    keys: a new stream's estimator keys, one object for all its streams (`EstimatorKeys` works out each
    chunk's bookkeeping once for the streams in step).
    """

    tokens: torch.Tensor
    spks: torch.Tensor
    prompt_mel: torch.Tensor
    encoder: ConformerCache
    estimator_cnn: torch.Tensor
    estimator_kv: torch.Tensor
    keys: EstimatorKeys

    @property
    def prompt_frames(self) -> int:
        return self.prompt_mel.shape[2]

    @property
    def nbytes(self) -> int:
        tensors = (self.tokens, self.spks, self.prompt_mel, self.estimator_cnn, self.estimator_kv)
        return sum(t.nbytes for t in tensors) + self.encoder.nbytes


class DiTStream(FlowStream):
    """One utterance: the speaker's shared prompt state plus this stream's own caches.

    encoder: conv contexts and the keys/values of this stream's tokens (prompt excluded);
    estimator_cnn: (steps, depth, 2, 2·hidden, 2); estimator_kv: (steps, depth, 2, heads, T, 2·hd) of
    this stream's kept generated frames, oldest first; keys: which frames the estimator attends to
    (`keys.own` are those of estimator_kv) and where the next chunk's noise starts.
    """

    def __init__(self, speaker: DiTSpeaker, keys: EstimatorKeys) -> None:
        self.speaker = speaker
        self.encoder = ConformerCache(
            lookahead=speaker.encoder.lookahead,
            upsample=speaker.encoder.upsample,
            token_kv=speaker.encoder.token_kv[:, :, :, :0],
            frame_kv=speaker.encoder.frame_kv[:, :, :, :0],
        )
        self.estimator_cnn = speaker.estimator_cnn
        self.estimator_kv = speaker.estimator_kv[:, :, :, :, :0]
        self.keys = keys
        self.closed = False
        # Set while a `FlowLaunch` holds this stream's cache updates: its next chunk would read stale caches.
        self.awaiting_caches = False

    @property
    def frames(self) -> int:
        """Mel frames generated so far."""
        return self.keys.generated

    def prompt_index(self) -> torch.Tensor | None:
        """Indices of the prompt frames still attended to (on the flow's device), None for all."""
        kept = self.keys.prompt
        if kept is None:
            return None
        return torch.tensor(kept, dtype=torch.int64, device=self.estimator_kv.device)

    @property
    def nbytes(self) -> int:
        if self.closed:
            return 0
        return self.encoder.nbytes + self.estimator_cnn.nbytes + self.estimator_kv.nbytes

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        del self.speaker, self.encoder, self.estimator_cnn, self.estimator_kv


@dataclass(frozen=True)
class _StreamUpdates:
    """The cache updates one batch of a `launch_chunks` call left, its streams and their places in the
    call."""

    streams: list[DiTStream]
    positions: list[int]
    updates: tuple[Callable[[], None], ...]

    def run(self) -> None:
        for update in self.updates:
            update()
        for stream in self.streams:
            stream.awaiting_caches = False


class FlowLaunch:
    """A `DiTFlow.launch_chunks` call: one mel (1, 80, F_i) per stream with tokens, views of buffers that
    the flow's next call overwrites, and the streams' cache updates, which `update_streams` queues (once;
    streams closed by then are skipped: their caches are dropped). Until then the streams must not run
    another chunk."""

    def __init__(self, mels: list[torch.Tensor], pending: _StreamUpdates | None) -> None:
        self.mels = mels
        self._pending = pending

    @torch.inference_mode()
    def update_streams(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.run()


@dataclass(frozen=True)
class _Row:
    """One stream's chunk inside a batch: `tokens` on the CPU, `out_tokens` of them encoded."""

    stream: DiTStream
    tokens: torch.Tensor
    out_tokens: int

    @property
    def speaker(self) -> DiTSpeaker:
        return self.stream.speaker


class DiTFlow(ConformerFlow):
    """`CausalMaskedDiffWithXvec` with the Step-Audio2 DiT; state dict = Step-Audio-2-mini `flow.pt`."""

    estimator_kind = "dit"

    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__(cfg)
        self.decoder = ConditionalCFM(DiT(cfg.dit), cfg.n_timesteps, cfg.cfg_rate, NOISE_FRAMES)
        self.buckets = Buckets()
        self.solve_memory: SolveMemory | None = None  # the bytes cap on a batch's solve (None: rows only)
        self._bucketed: RaggedSolver | None = None
        self._bucketed_encoder: EncoderRunner | None = None

    def _empty_estimator_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero conv contexts and no keys/values, per Euler step and guidance row."""
        dit, steps = self.cfg.dit, self.cfg.n_timesteps
        cnn = torch.zeros(steps, dit.depth, GUIDANCE_BATCH, 2 * dit.hidden_size, 2,
                          device=self.device, dtype=self.dtype)
        kv = torch.zeros(steps, dit.depth, GUIDANCE_BATCH, dit.num_heads, 0, 2 * dit.head_dim,
                         device=self.device, dtype=self.dtype)
        return cnn, kv

    # -- FlowModel --------------------------------------------------------------------------------------

    @torch.inference_mode()
    def prepare_speaker(self, voice: VoicePrompt) -> DiTSpeaker:
        lookahead = self.cfg.encoder.pre_lookahead
        if voice.num_tokens < lookahead:
            raise ValueError(f"a voice prompt needs at least {lookahead} tokens, got {voice.num_tokens}")
        tokens = voice.speech_tokens.to(self.device)
        spks = self._speaker_vector(voice.speaker_embedding)
        prompt_mel = self._prompt_mel(voice)
        empty = ConformerCache.empty(self.cfg.encoder, 1, self.device, self.dtype)
        encoded, encoder = self.encoder.forward_chunk(
            self._embed(torch.cat([tokens, tokens[:lookahead]])), empty, last=False
        )
        cnn, kv = self._empty_estimator_cache()
        _, cnn, kv = self.decoder.solve_chunk(self._mu(encoded), spks, prompt_mel, 0, cnn, None, kv)
        keys = EstimatorKeys.start(self.cfg.att_cache_rule, self.cfg.att_cache_recent_frames,
                                   prompt_mel.shape[2])
        return DiTSpeaker(tokens, spks, prompt_mel, encoder, cnn, kv, keys)

    def open_stream(self, speaker: FlowSpeaker) -> DiTStream:
        if not isinstance(speaker, DiTSpeaker):
            raise TypeError(f"DiTFlow needs a DiTSpeaker, got {type(speaker).__name__}")
        return DiTStream(speaker, speaker.keys)

    @torch.inference_mode()
    def chunk(self, stream: FlowStream, tokens: torch.Tensor, last: bool) -> torch.Tensor:
        if not isinstance(stream, DiTStream) or stream.closed:
            raise ValueError("chunk() needs an open DiTStream")
        lookahead = self.cfg.encoder.pre_lookahead
        if not last and tokens.numel() <= lookahead:
            raise ValueError(f"a non-final chunk needs more than {lookahead} tokens, got {tokens.numel()}")
        if tokens.numel() == 0:
            return torch.zeros(1, MEL_BINS, 0, device=self.device, dtype=self.dtype)
        speaker = stream.speaker
        encoded, update = self.encoder.forward_chunk(
            self._embed(tokens), speaker.encoder.extend(stream.encoder), last
        )
        mu = self._mu(encoded)
        keys, prompt_index = stream.keys, stream.prompt_index()
        prompt_kv = speaker.estimator_kv
        if prompt_index is not None:
            prompt_kv = prompt_kv.index_select(4, prompt_index)
        mel, cnn, kv = self.decoder.solve_chunk(
            mu,
            speaker.spks,
            torch.zeros_like(mu),  # the prompt conditions through the caches only
            keys.noise_offset,
            stream.estimator_cnn,
            prompt_kv,
            stream.estimator_kv,
        )
        after = keys.after_chunk(mel.shape[2])
        kept = torch.tensor(keys.kept_positions(after), dtype=torch.int64, device=self.device)
        stream.estimator_cnn = cnn
        stream.estimator_kv = torch.cat([stream.estimator_kv, kv], dim=4).index_select(4, kept)
        stream.keys = after
        stream.encoder = stream.encoder.extend(update)
        return mel

    # -- batches of streams -----------------------------------------------------------------------------

    @property
    def batches_streams(self) -> bool:
        """Whether `chunks` batches streams: the estimator is the PyTorch DiT (not an exported one)."""
        return isinstance(self.decoder.estimator, RaggedEstimator)

    @property
    def graphs(self) -> GraphedSolver | None:
        return self._bucketed if isinstance(self._bucketed, GraphedSolver) else None

    @property
    def encoder_graphs(self) -> EncoderRunner | None:
        """The bucketed encoder (`use_bucketed_solver`'s `encoder`), or None."""
        return self._bucketed_encoder

    def use_bucketed_solver(self, solver: RaggedSolver | None, buckets: Buckets | None = None,
                            encoder: EncoderRunner | None = None) -> None:
        """Solve batches that fit `buckets` with `solver` at their bucket's shape, and encode them with
        `encoder` likewise (`GraphedSolver` / `GraphedEncoder`: see `enable_cuda_graphs`); other batches,
        and all of them without a solver or encoder, run eagerly at their exact shape."""
        self._bucketed = solver
        self._bucketed_encoder = encoder
        if buckets is not None:
            self.buckets = buckets

    def limit_solve_memory(self, budget_bytes: int | None) -> None:
        """Plan batches whose padded solve needs at most `budget_bytes` (solve_memory.py; None: no cap).
        Set it before the warm-up: the graphs it captures are those of the batches planned."""
        layout = SolverLayout.of(self.cfg, self.dtype, self.device)
        self.solve_memory = None if budget_bytes is None else SolveMemory(layout, budget_bytes)

    def enable_cuda_graphs(self, buckets: Buckets | None = None,
                           precompiled: Path | None = None) -> GraphedSolver:
        """Encode and solve batches that fit the buckets with CUDA graphs (captured on the first use of a
        shape). Needs the flow on a CUDA device, in its final dtype. `precompiled`: where the compiled DiT
        block's variants are kept across processes (`DiT.compile_blocks`)."""
        graphs = self.graphs
        if graphs is None:
            layout = SolverLayout.of(self.cfg, self.dtype, self.device)
            graphs = GraphedSolver(self.decoder, layout, precompiled)
        encoder = self._bucketed_encoder
        if not isinstance(encoder, GraphedEncoder):
            encoder = GraphedEncoder(self._encode_inputs, self._encoder_layout)
        self.use_bucketed_solver(graphs, buckets, encoder)
        return graphs

    @torch.inference_mode()
    def capture_graph(self, shape: SolveShape | EncodeShape) -> bool:
        """Capture the graph of a bucketed solve or encoder shape (warmup_shapes.py's
        `planned_solve_shapes`, `later_graph_shapes`) unless it is captured already; whether it was
        captured now."""
        solver, encoder = self.graphs, self._bucketed_encoder
        if isinstance(shape, SolveShape) and solver is not None:
            return solver.capture_missing(shape)
        if isinstance(shape, EncodeShape) and isinstance(encoder, GraphedEncoder):
            return encoder.capture_missing(shape)
        return False

    def graph_sets(self) -> list[GraphedSolver | GraphedEncoder]:
        """The solve's and the encoder's CUDA graphs (none without `enable_cuda_graphs`)."""
        return [graphs for graphs in (self.graphs, self._bucketed_encoder)
                if isinstance(graphs, GraphedSolver | GraphedEncoder)]

    def pause_graphs(self) -> None:
        """Compile no block from now on, and capture graphs only inside their `capturing` (a warm-up
        that goes on between serving calls: see graphs.py)."""
        if isinstance(self.decoder.estimator, DiT):
            self.decoder.estimator.seal_compilation()
        for graphs in self.graph_sets():
            graphs.pause()

    def seal_graphs(self) -> None:
        """From now on capture no graph and compile no block: shapes without one run in a graph holding
        them, else eagerly (see graphs.py)."""
        if isinstance(self.decoder.estimator, DiT):
            self.decoder.estimator.seal_compilation()
        for graphs in self.graph_sets():
            graphs.seal()
            logger.info("%s: %d graphs, %.2f GiB of static inputs and outputs", type(graphs).__name__,
                        len(graphs.shapes), graphs.static_bytes / 2**30)

    @property
    def _encoder_layout(self) -> EncoderLayout:
        return EncoderLayout(self.cfg.encoder, self.cfg.output_size, self.dtype, self.device)

    def chunks(
        self, streams: Sequence[FlowStream], tokens: Sequence[torch.Tensor], lasts: Sequence[bool]
    ) -> list[torch.Tensor]:
        """`chunk` for distinct streams at once: one mel (1, 80, F_i) per stream, equal to running each
        stream alone up to float rounding (padding is masked; see batching.py)."""
        launch = self.launch_chunks(streams, tokens, lasts)
        with torch.inference_mode():
            mels = [mel.clone() for mel in launch.mels]
        launch.update_streams()
        return mels

    @torch.inference_mode()
    def launch_chunks(
        self, streams: Sequence[FlowStream], tokens: Sequence[torch.Tensor], lasts: Sequence[bool]
    ) -> FlowLaunch:
        """`chunks`, leaving the streams' cache copies to the caller (`FlowLaunch.update_streams`), to be
        queued once what reads the mels is (the vocoder): they are not on the way to this call's audio."""
        if not self.batches_streams:
            raise TypeError(f"{type(self.decoder.estimator).__name__} cannot batch streams; use chunk()")
        if not len(streams) == len(tokens) == len(lasts):
            raise ValueError(f"{len(streams)} streams, {len(tokens)} token tensors, {len(lasts)} flags")
        if len({id(s) for s in streams}) != len(streams):
            raise ValueError("a batch holds at most one chunk per stream")
        lookahead = self.cfg.encoder.pre_lookahead
        mels: list[torch.Tensor | None] = [None] * len(streams)
        rows: list[_Row] = []
        positions: list[int] = []
        for index, (stream, ids, last) in enumerate(zip(streams, tokens, lasts, strict=True)):
            if not isinstance(stream, DiTStream) or stream.closed:
                raise ValueError("chunks() needs open DiTStreams")
            if stream.awaiting_caches:
                raise RuntimeError("a stream's last chunk has not updated its caches yet "
                                   "(FlowLaunch.update_streams)")
            if not last and ids.numel() <= lookahead:
                raise ValueError(f"a non-final chunk needs more than {lookahead} tokens, got {ids.numel()}")
            if ids.numel() == 0:
                mels[index] = torch.zeros(1, MEL_BINS, 0, device=self.device, dtype=self.dtype)
                continue
            host_ids = ids if ids.device.type == "cpu" else ids.cpu()  # the server's tokens are on the host
            rows.append(_Row(stream, host_ids, ids.numel() - (0 if last else lookahead)))
            positions.append(index)
        voices: dict[DiTSpeaker, int] = {}
        ratio = self.cfg.token_mel_ratio
        specs = []
        for row in rows:
            frames = ratio * row.out_tokens
            voice = voices.setdefault(row.speaker, len(voices))
            specs.append(RowSpec(frames, voice, row.speaker.prompt_frames,
                                 own_frames=row.stream.estimator_kv.shape[4],
                                 kept_frames=len(row.stream.keys.after_chunk(frames).own)))
        fits = None if self.solve_memory is None else self.solve_memory.fits
        pending: _StreamUpdates | None = None
        for planned in plan_batches(specs, self.buckets, fits):
            if pending is not None:
                # This batch's graphs overwrite the buffers that the last one's mels and updates read
                # (and a failure of this batch leaves the last one's streams complete).
                earlier, pending = pending, None
                earlier.run()
                for index in earlier.positions:
                    mel = mels[index]
                    assert mel is not None
                    mels[index] = mel.clone()
            # Rows of one voice and equal own length side by side: they share prompt copies.
            batch = sorted(planned, key=lambda i: (specs[i].voice, rows[i].stream.encoder.num_tokens))
            batch_rows = [rows[i] for i in batch]
            mu, encoder_updates = self._encode_batch(batch_rows)
            solved, solver_updates = self._solve_batch(batch_rows, mu)
            for i, mel in zip(batch, solved, strict=True):
                mels[positions[i]] = mel
            for row in batch_rows:
                row.stream.awaiting_caches = True
            pending = _StreamUpdates([row.stream for row in batch_rows], [positions[i] for i in batch],
                                     (encoder_updates, solver_updates))
        return FlowLaunch([mel for mel in mels if mel is not None], pending)

    def _encode_batch(self, rows: Sequence[_Row]) -> tuple[torch.Tensor, Callable[[], None]]:
        """Encode the rows' chunks: mu (B, 80, 2·M), right-padded, and the update of the rows' encoder
        caches (to run before the encoder's next call)."""
        enc = self.cfg.encoder
        stride, real = enc.up_stride, len(rows)
        history = [row.speaker.encoder.num_tokens + row.stream.encoder.num_tokens for row in rows]
        tokens = max(row.out_tokens for row in rows)
        encoder, shape = self._encoder(EncodeShape(real, tokens, max(history)))
        inputs = encoder.buffers(shape)
        # Host-built ids and lengths, one copy each; padding rows: one token, nothing cached.
        ids = torch.zeros(shape.batch, shape.tokens + enc.pre_lookahead, dtype=torch.int64)
        for i, row in enumerate(rows):
            ids[i, : row.tokens.numel()] = row.tokens
        lengths = torch.ones(3, shape.batch, dtype=torch.int64)
        lengths[2] = 0
        lengths[:, :real] = torch.tensor([[row.tokens.numel() for row in rows],
                                          [row.out_tokens for row in rows], history])
        inputs.ids.copy_(upload(ids, self.device))
        inputs.lengths.copy_(upload(lengths, self.device))
        self._fill_history(inputs.cache, rows, stride)
        out = encoder.run(shape)
        update = out.update

        def extend_caches() -> None:
            # Conv contexts are small: one copy for all rows, out of buffers the next call overwrites.
            lookahead, upsample = update.lookahead[:real].clone(), update.upsample[:real].clone()
            for i, row in enumerate(rows):
                if row.stream.closed:
                    continue
                own = ConformerCache(lookahead[i : i + 1], upsample[i : i + 1],
                                     update.token_kv[:, i : i + 1, :, : row.out_tokens],
                                     update.frame_kv[:, i : i + 1, :, : stride * row.out_tokens])
                row.stream.encoder = row.stream.encoder.extend(own)

        return out.mu[:real, :, : stride * tokens], extend_caches

    def _encoder(self, exact: EncodeShape) -> tuple[EncoderRunner, EncodeShape]:
        """The bucketed encoder at the bucket holding `exact` (or at a captured graph's shape holding it:
        `ShapeGraphs.stand_in`), or an eager one at `exact`."""
        encoder = self._bucketed_encoder
        shape = None if encoder is None else self.buckets.encode_shape(exact, self.cfg.encoder.up_stride)
        if encoder is not None and shape is not None:
            return encoder, encoder.stand_in(shape) if isinstance(encoder, GraphedEncoder) else shape
        return EagerEncoder(self._encode_inputs, self._encoder_layout), exact

    def _encode_inputs(self, inputs: EncoderInputs) -> tuple[torch.Tensor, ConformerCache]:
        """mu of a padded batch (see `UpsampleConformerEncoder.forward_chunks`) and the rows' update."""
        embedded = self.input_embedding(inputs.ids.clamp_min(0))
        token_lengths, out_lengths, cache_lengths = inputs.lengths.unbind()
        encoded, update = self.encoder.forward_chunks(embedded, token_lengths, out_lengths, inputs.cache,
                                                      cache_lengths)
        return self._mu(encoded), update

    @staticmethod
    def _fill_history(cache: ConformerCache, rows: Sequence[_Row], stride: int) -> None:
        """Write the rows' conv contexts and [prompt, own] keys/values into `cache`, left-padded. Rows
        are ordered by voice and own length (see `chunks`): a run of rows sharing both gets its voice's
        prompt in one copy and its own histories in one concatenation per cache."""
        end = cache.num_tokens
        torch.cat([row.stream.encoder.lookahead for row in rows], out=cache.lookahead[: len(rows)])
        torch.cat([row.stream.encoder.upsample for row in rows], out=cache.upsample[: len(rows)])
        first = 0
        runs = itertools.groupby(rows, key=lambda row: (row.speaker, row.stream.encoder.num_tokens))
        for (speaker, own), run in runs:
            histories = [row.stream.encoder for row in run]
            start, stop = end - own - speaker.encoder.num_tokens, end - own
            run_rows = slice(first, first + len(histories))
            first += len(histories)
            prompt = speaker.encoder
            copy_words_(cache.token_kv[:, run_rows, :, start:stop], prompt.token_kv)
            copy_words_(cache.frame_kv[:, run_rows, :, stride * start : stride * stop], prompt.frame_kv)
            if own:
                cat_words_into_(cache.token_kv[:, run_rows, :, stop:], [h.token_kv for h in histories], dim=1)
                cat_words_into_(cache.frame_kv[:, run_rows, :, stride * stop :],
                                [h.frame_kv for h in histories], dim=1)

    def _solver(self, exact: SolveShape) -> tuple[RaggedSolver, SolveShape]:
        """The bucketed solver at the bucket holding `exact` (or at a captured graph's shape holding it:
        `ShapeGraphs.stand_in`), or the eager one at `exact`."""
        solver = self._bucketed
        shape = None if solver is None else self.buckets.shape(exact)
        if solver is not None and shape is not None:
            return solver, solver.stand_in(shape) if isinstance(solver, GraphedSolver) else shape
        return EagerSolver(self.decoder, SolverLayout.of(self.cfg, self.dtype, self.device)), exact

    def _solve_batch(self, rows: Sequence[_Row], mu: torch.Tensor
                     ) -> tuple[list[torch.Tensor], Callable[[], None]]:
        """Run the CFM over the rows' encoded chunks mu (B, 80, T): each row's mel (a view of buffers the
        solver's next call overwrites) and the update of the rows' estimator caches (to run before it)."""
        real, _, frames = mu.shape
        lengths = [self.cfg.token_mel_ratio * row.out_tokens for row in rows]
        own_lengths = [row.stream.estimator_kv.shape[4] for row in rows]
        afters = [row.stream.keys.after_chunk(length) for row, length in zip(rows, lengths, strict=True)]
        kept = [row.stream.keys.kept_positions(after) for row, after in zip(rows, afters, strict=True)]
        speakers = list(dict.fromkeys(row.speaker for row in rows))
        exact = SolveShape(real, frames, max(own_lengths), sum(sp.prompt_frames for sp in speakers),
                           max(len(k) for k in kept))
        solver, shape = self._solver(exact)
        inputs = solver.buffers(shape)
        batch, own_frames, kept_frames = shape.batch, shape.own_frames, shape.kept_frames

        # Host-built index data, one copy each; padded rows: one real frame, no history.
        row_lengths = torch.ones(batch, dtype=torch.int64)
        row_lengths[:real] = torch.tensor(lengths)
        own = torch.zeros(batch, dtype=torch.int64)
        own[:real] = torch.tensor(own_lengths)
        offsets = torch.zeros(batch, dtype=torch.int64)
        offsets[:real] = torch.tensor([row.stream.keys.noise_offset for row in rows])
        # Each row's kept frames of [own cache (left-padded to own_frames), chunk], right-aligned.
        keep = torch.zeros(batch, kept_frames, dtype=torch.int64)
        prompt_mask = torch.zeros(batch, shape.prompt_frames, dtype=torch.bool)
        starts: dict[DiTSpeaker, int] = {}
        for speaker in speakers:
            starts[speaker] = sum(sp.prompt_frames for sp in starts)
        # Rows in step share their keys (`DiTSpeaker.keys`) and so their kept positions: one indexing op
        # per group of them. The ids are of objects the rows and `kept` hold for the whole call.
        attended: dict[int, list[int]] = {}
        kept_rows: dict[tuple[int, int], list[int]] = {}
        for i, (row, cached, positions) in enumerate(zip(rows, own_lengths, kept, strict=True)):
            attended.setdefault(id(row.stream.keys), []).append(i)
            if positions:
                kept_rows.setdefault((id(positions), cached), []).append(i)
        for indices in attended.values():
            row = rows[indices[0]]
            start, prompt = starts[row.speaker], row.stream.keys.prompt
            if prompt is None:
                prompt_mask[indices, start : start + row.speaker.prompt_frames] = True
            elif prompt:
                columns = torch.tensor(prompt, dtype=torch.int64) + start
                prompt_mask[torch.tensor(indices)[:, None], columns] = True
        for (_, cached), indices in kept_rows.items():
            positions = kept[indices[0]]
            keep[indices, kept_frames - len(positions) :] = (torch.tensor(positions, dtype=torch.int64)
                                                              + (own_frames - cached))
        mask = torch.cat([prompt_mask, span_mask(own_frames, shape.frames, own, row_lengths)], dim=1)
        inputs.lengths.copy_(upload(row_lengths, self.device))
        inputs.offsets.copy_(upload(offsets, self.device))
        inputs.keep.copy_(upload(keep, self.device))
        inputs.mask.copy_(upload(torch.cat([mask, mask]), self.device))

        inputs.mu.zero_()
        inputs.mu[:real, :, :frames] = mu
        inputs.spks.zero_()
        inputs.spks[:real] = torch.cat([row.speaker.spks for row in rows])
        for speaker, start in starts.items():
            copy_words_(inputs.prompt_kv[..., start : start + speaker.prompt_frames, :], speaker.estimator_kv)
        steps, depth = inputs.cnn_cache.shape[:2]
        cnn = inputs.cnn_cache.view(steps, depth, 2, batch, *inputs.cnn_cache.shape[3:])
        cnn[:, :, :, :real] = torch.stack([row.stream.estimator_cnn for row in rows], dim=3)
        own_kv = inputs.own_kv.view(steps, depth, 2, batch, *inputs.own_kv.shape[3:])
        first = 0  # runs of rows with equal cached lengths: one call each
        for cached, pairs in itertools.groupby(zip(rows, own_lengths, strict=True), key=lambda pair: pair[1]):
            run = [row for row, _ in pairs]
            run_rows = slice(first, first + len(run))
            first += len(run)
            if cached:
                cat_words_into_(own_kv[:, :, :, run_rows, :, own_frames - cached :],
                                [row.stream.estimator_kv.unsqueeze(3) for row in run], dim=3)

        out = solver.run(shape)
        new_kv = out.kept_kv.view(steps, depth, 2, batch, *out.kept_kv.shape[3:])
        new_cnn = out.cnn_cache.view(steps, depth, 2, batch, *out.cnn_cache.shape[3:])

        def keep_caches() -> None:
            for i, (row, after) in enumerate(zip(rows, afters, strict=True)):
                if row.stream.closed:
                    continue
                count = len(kept[i])
                row.stream.estimator_kv = clone_words(new_kv[:, :, :, i, :, kept_frames - count :])
                row.stream.estimator_cnn = new_cnn[:, :, :, i].clone()
                row.stream.keys = after

        return [out.mel[i : i + 1, :, :length] for i, length in enumerate(lengths)], keep_caches

    @torch.inference_mode()
    def offline(
        self, speaker: FlowSpeaker, tokens: torch.Tensor, chunk_layout: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Mel (1, 80, 2N) of N tokens with full attention over prompt and tokens (MODEL_FACTS §5.4).

        chunk_layout: token counts of streaming chunks (hops, then the rest); attention then becomes
        block-causal over [prompt, chunk 1, chunk 2, …] — what streaming computes, except that streaming
        shows the prompt's last tokens a stand-in lookahead (the prompt's first 3 tokens).
        """
        if not isinstance(speaker, DiTSpeaker):
            raise TypeError(f"DiTFlow needs a DiTSpeaker, got {type(speaker).__name__}")
        all_tokens = torch.cat([speaker.tokens, tokens.to(self.device)])
        n = all_tokens.numel()
        token_mask = None
        if chunk_layout is not None:
            if sum(chunk_layout) != tokens.numel():
                raise ValueError(f"chunk_layout {list(chunk_layout)} does not add up to {tokens.numel()}")
            token_mask = blocks_attention_mask([speaker.tokens.numel(), *chunk_layout], self.device)
        encoded, _ = self.encoder(self._embed(all_tokens), torch.tensor([n], device=self.device), token_mask)
        mu = self._mu(encoded)
        cond = torch.zeros_like(mu)
        cond[:, :, : speaker.prompt_frames] = speaker.prompt_mel
        ratio = self.cfg.token_mel_ratio
        if token_mask is None:
            mask = torch.ones(1, 1, mu.shape[2], dtype=torch.bool, device=self.device)
        else:
            mask = token_mask.repeat_interleave(ratio, 0).repeat_interleave(ratio, 1)[None]
        mel = self.decoder.solve(mu, mask, speaker.spks, cond)
        return mel[:, :, speaker.prompt_frames :]


def load_dit_flow(path: Path, cfg: FlowConfig, device: torch.device | str, dtype: torch.dtype) -> DiTFlow:
    """A DiTFlow with the weights of a Step-Audio-2-mini `flow.pt`, strictly checked, in eval mode."""
    return DiTFlow.load(path, cfg, device, dtype)
