"""The device side of the PyTorch LLM engine: its configuration, and the model runner.

`TorchLLMConfig` fixes every call shape (decode batch sizes, attended cache lengths, prefill rows and
chunk lengths), so that each shape can be captured once as a CUDA graph. `ModelRunner` owns the model,
its slot KV cache, the static buffers those shapes read and write, and the graphs; it launches prefill
and decode calls without waiting for the device. Which sequence runs when is the engine loop's business
(`engines/llm/torch_engine.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Literal, Protocol

import torch
from torch import Tensor

from engines.cuda_graphs import capture_graph
from engines.llm.base import ALL_MODES, LLMRequest, PromptMode
from engines.llm.model import DTYPES, CosyVoice2LM
from engines.llm.qwen2 import CacheBatch, KVCache
from engines.llm.sampling import SamplingSlots
from engines.transfer import upload


@dataclass(frozen=True)
class TorchLLMConfig:
    """How the engine runs; `dtype="auto"` is bf16 on CUDA and fp32 elsewhere."""

    device: str = "cuda"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_slots: int = 64
    max_context: int = 2048  # prompt + generated positions per request
    max_waiting: int = 256
    prefill_chunk: int = 512  # positions of one prompt prefilled per engine step
    # Padded positions (rows x chunk length) of one prefill call, and prompts per call (padded up to one
    # of these): a burst of 64 arrivals is prefilled in two calls rather than eight.
    prefill_tokens: int = 8192
    prefill_rows: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # Padded positions a prefill call may compute for rows beyond its prompts (None: no limit). Past it the
    # call takes the prompts of the next smaller row bucket and leaves the rest for the next step: a call
    # of 17 prompts padded to 32 rows costs nearly what 32 prompts do once the matmuls are compute-bound.
    prefill_padding_limit: int | None = None
    cuda_graphs: bool = True  # only used on CUDA
    fused_elementwise: bool = True  # only used on CUDA: rope and SwiGLU compiled into one kernel each
    # Only used on CUDA (bf16/fp16): decode steps attend through engines/llm/decode_attention.py's kernel
    decode_attention_kernel: bool = True
    # Only used with the decode attention kernel: decode steps of at most 16 rows run their norms and
    # projections through engines/llm/decode_linear.py's kernels (4 launches per layer besides attention)
    decode_linear_kernels: bool = True
    # Only used on CUDA: a step's sampling and its bookkeeping run as one Triton kernel
    # (engines/llm/sampling_kernel.py) instead of ~50 small ones
    fused_sampling: bool = True
    # Only used with the decode attention kernel on Hopper or later: it and the decode projections are
    # launched with programmatic dependent launch (engines/llm/programmatic_launch.py) at the rows the
    # projections serve (H200: decode steps 8 % shorter at 1 and 16 rows; docs/benchmarks.md, 27th session)
    programmatic_launch: bool = True
    decode_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    min_kv_bucket: int = 256  # attended cache lengths: doubling from here up to max_context
    # Prefill calls of first chunks reaching at most this many positions replay graphs, all captured at
    # this one cache length: one graph per shape, for ~0.14 s each at start-up. Longer prompts and their
    # later chunks (rare: a voice prompt and its text fit 512) prefill eagerly, where launches hide
    # behind the matmuls.
    prefill_graph_kv: int = 512
    prefill_length_step: int = 64  # prefill chunk lengths: multiples of this up to prefill_chunk
    ras_history: int = 32  # longest RAS window a request may ask for
    # Only used on CUDA: where the compiled elementwise functions are kept for later processes (the
    # models' compile cache; None: compiled in each process). See LayerKernels.compiled.
    precompiled: Path | None = None
    # Prompt modes served: all three by default; a models directory whose LLM was fine-tuned for one
    # mode only may turn the others off.
    modes: frozenset[PromptMode] = ALL_MODES

    def __post_init__(self) -> None:
        if not self.modes:
            raise ValueError("TorchLLMConfig.modes must name at least one prompt mode")
        sizes = ("max_slots", "max_context", "max_waiting", "prefill_chunk", "prefill_tokens",
                 "min_kv_bucket", "prefill_graph_kv", "prefill_length_step", "ras_history")
        for name in sizes:
            if getattr(self, name) < 1:
                raise ValueError(f"TorchLLMConfig.{name} must be positive, got {getattr(self, name)}")
        for name in ("decode_buckets", "prefill_rows"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be positive sizes, got {getattr(self, name)}")
        if self.prefill_padding_limit is not None and self.prefill_padding_limit < 0:
            raise ValueError(f"TorchLLMConfig.prefill_padding_limit must be 0 or more, "
                             f"got {self.prefill_padding_limit}")
        if self.prefill_lengths[-1] > self.prefill_tokens:
            raise ValueError(f"prefill_tokens {self.prefill_tokens} must hold one chunk of "
                             f"{self.prefill_lengths[-1]}")

    @cached_property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    @cached_property
    def batch_sizes(self) -> tuple[int, ...]:
        """Decode batch sizes, ascending; the largest is `max_slots`."""
        return tuple(sorted({b for b in self.decode_buckets if b < self.max_slots} | {self.max_slots}))

    @cached_property
    def kv_lengths(self) -> tuple[int, ...]:
        """Cache prefixes attention reads, ascending; the largest is `max_context`."""
        return doubling(self.min_kv_bucket, self.max_context)

    @cached_property
    def prefill_lengths(self) -> tuple[int, ...]:
        """Padded prefill chunk lengths, ascending; the largest is `prefill_chunk`."""
        step = self.prefill_length_step
        return (*range(step, self.prefill_chunk, step), self.prefill_chunk)

    @cached_property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, chunk length) of every prefill call: the padded positions stay within `prefill_tokens`."""
        return tuple((rows, length) for rows in sorted(set(self.prefill_rows))
                     for length in self.prefill_lengths if rows * length <= self.prefill_tokens)

    @cached_property
    def prefill_graph_kv_len(self) -> int:
        """The attended length of every prefill graph: the cache bucket holding `prefill_graph_kv`."""
        return bucket(self.kv_lengths, min(self.prefill_graph_kv, self.max_context))

    def prefill_kv_len(self, needed: int) -> int:
        """The attended length of a prefill call whose rows reach `needed` positions: the graphs' one
        up to it, else the cache bucket holding `needed` (eagerly)."""
        if needed <= self.prefill_graph_kv_len:
            return self.prefill_graph_kv_len
        return bucket(self.kv_lengths, needed)

    def prefill_prompts_taken(self, prompts: int, longest: int) -> int:
        """How many of `prompts` prompts in line (chunks of at most `longest` positions, a call's shape
        for all of them existing) one prefill call takes: all, unless padding them up to the call's row
        bucket computes more than `prefill_padding_limit` positions; then the largest row bucket below."""
        shape = self.prefill_shape(prompts, longest)
        if shape is None or self.prefill_padding_limit is None:
            return prompts
        rows, length = shape
        if (rows - prompts) * length <= self.prefill_padding_limit:
            return prompts
        return max((r for r in self.prefill_rows if r <= prompts), default=prompts)

    def prefill_shape(self, rows: int, longest: int) -> tuple[int, int] | None:
        """The smallest prefill call shape for `rows` chunks of at most `longest` positions, if any."""
        return next(((r, n) for r, n in self.prefill_shapes if r >= rows and n >= longest), None)


def doubling(smallest: int, largest: int) -> tuple[int, ...]:
    sizes = []
    while smallest < largest:
        sizes.append(smallest)
        smallest *= 2
    return (*sizes, largest)


def bucket(sizes: tuple[int, ...], needed: int) -> int:
    """The smallest of the ascending `sizes` that holds `needed`."""
    return next(size for size in sizes if size >= needed)

class Admitted(Protocol):
    """What the runner reads of a newly admitted sequence to set up its slot."""

    @property
    def request(self) -> LLMRequest: ...
    @property
    def slot(self) -> int: ...
    @property
    def prompt_len(self) -> int: ...
    @property
    def min_len(self) -> int: ...
    @property
    def seed(self) -> int: ...


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt embeddings [T, hidden] for positions start..start+T of `slot`; `last` ends the prompt."""

    slot: int
    embeddings: Tensor
    start: int
    last: bool


class Readback:
    """One launch's sampled tokens on their way to the host; `lists()` waits for them.

    The copy lands in one of the runner's pinned buffers (`ReadbackRing`), so starting one costs two
    calls into torch (copy, event record) and finishing it two (wait, list). Allocating pinned tensors
    and an event every step instead cost the engine thread ~1.5 of 7 s beside token2wav at 128 streams,
    and doubled the step time (docs/benchmarks.md, ninth session)."""

    def __init__(self, host: Tensor, event: torch.cuda.Event | None, prefill_rows: int, decode_rows: int,
                 decode_offset: int) -> None:
        self._host, self._event = host, event
        self._prefill_rows, self._decode = prefill_rows, slice(decode_offset, decode_offset + decode_rows)

    def lists(self) -> tuple[list[int], list[int]]:
        """The prefill rows' first tokens and the decode rows' next tokens."""
        if self._event is not None:
            self._event.synchronize()
        values = self._host.tolist()
        return values[: self._prefill_rows], values[self._decode]


class ReadbackRing:
    """Two pinned host buffers and events, used in turn: the engine finishes a launch's read-back before
    it starts the read-back after next (`_step`: launch N + 1, then complete N)."""

    def __init__(self, source: Tensor) -> None:
        cuda = source.is_cuda
        self._source = source
        self._buffers = [torch.empty(source.shape, dtype=source.dtype, pin_memory=cuda) for _ in range(2)]
        self._events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self._turn = 0

    def start(self) -> tuple[Tensor, torch.cuda.Event | None]:
        """Copy the source into the next buffer without waiting; its event marks the copy's end."""
        host, event = self._buffers[self._turn], self._events[self._turn]
        self._turn ^= 1
        host.copy_(self._source, non_blocking=self._source.is_cuda)
        if event is not None:
            event.record()
        return host, event


class ModelRunner:
    """The model, its slot KV cache, static input/output buffers and the CUDA graphs (device work only).

    Every model call has a bucketed static shape and reads its inputs from static buffers, so the same
    code runs eagerly (CPU) or as a replayed CUDA graph. No method waits for the device.

    Prefill calls take up to a bucketed number of rows, one prompt chunk each, padded to a bucket
    length. Padding queries write scratch keys/values just past their chunk (the cache has
    `prefill_chunk` spare positions for that), which the next chunk or decode step overwrites before
    anything reads them; padding rows use a scratch slot past the last real one.

    Slot invariants: `positions[s]` is where the slot's next input goes (its prompt length right after
    admission) and `active[s]` is set once its prefill has sampled the first token, until its last
    token is launched or it is released. Decode advances only active slots; idle slots in a decode
    batch write scratch keys/values at their position, which is past anything their sequence has stored.
    """

    def __init__(self, model: CosyVoice2LM, config: TorchLLMConfig) -> None:
        self.model = model
        self.config = config
        device, dtype, slots = config.torch_device, config.torch_dtype, config.max_slots
        llm = model.cfg
        self.scratch_slot = slots

        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        cache_len = config.max_context + config.prefill_chunk
        self.cache = KVCache.allocate(llm.qwen, slots + 1, cache_len, device, dtype)
        fused_sampling = device.type == "cuda" and config.fused_sampling
        self.sampling = SamplingSlots(slots + 1, llm.speech_vocab, config.ras_history, llm.stop_tokens,
                                      llm.eos_token, device,
                                      compiled=device.type == "cuda" and config.fused_elementwise
                                      and not fused_sampling,
                                      precompiled=config.precompiled, fused=fused_sampling)
        # Decode: per-slot input token and position, output token.
        # Sampled tokens, one buffer read back whole each step: prefill rows' first tokens, then each
        # slot's decoded token.
        max_rows = max(config.prefill_rows)
        self.tokens_out = zeros(max_rows + slots)
        self.prefill_sampled, self.sampled = self.tokens_out[:max_rows], self.tokens_out[max_rows:]
        self.next_token, self.positions = zeros(slots + 1), zeros(slots + 1)
        self.active = zeros(slots + 1, dtype=torch.bool)
        # Prefill: one chunk per row; per row its slot, start position, index of its last real position and
        # whether it ends the prompt (then its first token is sampled).
        self.prefill_input = zeros(max_rows, config.prefill_chunk, llm.qwen.hidden_size, dtype=dtype)
        self.prefill_rows = zeros(4, max_rows)
        self.readbacks = ReadbackRing(self.tokens_out)
        self.decode_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}

    def seal_compilation(self) -> None:
        """Compile no more variants of the kept functions (the layers' and the sampler's): once the
        graphs are captured, every shape class has been met."""
        self.model.backbone.ops.seal()
        self.sampling.seal()

    @torch.no_grad()
    def capture_graphs(self) -> None:
        """Capture every decode and prefill shape; every slot must be idle."""
        pool = None
        # High priority, as the engine's serving stream: never the stream of a token2wav thread that may
        # be warming up meanwhile (engines/cuda_graphs.py).
        stream = torch.cuda.Stream(self.config.torch_device, priority=-1)

        def capture(step: Callable[..., None], *shape: int) -> torch.cuda.CUDAGraph:
            nonlocal pool
            # Warm-up on one layer: the others launch the same kernels on the same shapes.
            graph = capture_graph(partial(step, *shape), pool, stream, warmup=partial(step, *shape, layers=1))
            pool = graph.pool()
            return graph

        self.prefill_rows[0].fill_(self.scratch_slot)  # capture on the scratch slot, like padding rows
        prefill_kv = self.config.prefill_graph_kv_len
        for kv_len in reversed(self.config.kv_lengths):
            for size in reversed(self.config.batch_sizes):
                self.decode_graphs[size, kv_len] = capture(self._decode_step, size, kv_len)
            if kv_len != prefill_kv:
                continue
            for rows, length in reversed(self.config.prefill_shapes):
                # First chunks only (`prefill` replays these for calls whose chunks all start at 0).
                graph = capture(self._prefill_step, rows, length, kv_len, True)
                self.prefill_graphs[rows, length, kv_len] = graph
        # This stream only: a device-wide wait is not allowed while another thread captures.
        torch.cuda.current_stream(self.config.torch_device).synchronize()

    @torch.no_grad()
    def begin(self, seqs: Sequence[Admitted]) -> list[Tensor]:
        """Set up the slots of newly admitted `seqs` and return their prompt embeddings [P, hidden].

        The work is batched over the sequences (admitting a burst costs a few kernels, not a few per
        request), and nothing waits for the device: the ids and settings travel in pinned copies.
        """
        requests = [seq.request for seq in seqs]
        texts = [[*r.prompt_text_ids, *r.text_ids] for r in requests]
        speech = [list(r.prompt_speech_tokens) for r in requests]
        device = self.config.torch_device
        ids = upload(torch.tensor([i for t in texts for i in t] + [i for s in speech for i in s]), device)
        text_count = sum(len(t) for t in texts)
        embeddings = self.model.prompt_embeddings_batch(ids[:text_count], [len(t) for t in texts],
                                                        ids[text_count:], [len(s) for s in speech])
        placement = torch.tensor([[seq.slot for seq in seqs], [seq.prompt_len for seq in seqs]])
        slots, prompt_lens = upload(placement, device)
        self.sampling.configure(slots, [(seq.request.sampling, seq.min_len, seq.seed) for seq in seqs])
        self.positions.index_copy_(0, slots, prompt_lens)
        self.active.index_fill_(0, slots, False)
        return embeddings

    def release(self, slot: int) -> None:
        self.active[slot].fill_(False)

    @torch.no_grad()
    def prefill(self, chunks: Sequence[PrefillChunk]) -> None:
        """Launch one prefill call over `chunks`, one row each; a row whose chunk is the `last` of its
        prompt samples the slot's first token (into `prefill_sampled[row]`) and makes the slot active."""
        shape = self.config.prefill_shape(len(chunks), max(chunk.embeddings.shape[0] for chunk in chunks))
        if shape is None:
            raise ValueError(f"no prefill shape holds {len(chunks)} chunks")
        rows, length = shape
        padding = [(self.scratch_slot, 0, 0, False)] * (rows - len(chunks))
        meta = [(c.slot, c.start, c.embeddings.shape[0] - 1, c.last) for c in chunks] + padding
        columns = torch.tensor(list(zip(*meta, strict=True)), dtype=torch.int64)  # [4, rows]
        self.prefill_rows[:, :rows].copy_(upload(columns, self.config.torch_device))
        for row, chunk in enumerate(chunks):
            self.prefill_input[row, : chunk.embeddings.shape[0]] = chunk.embeddings
        kv_len = self.config.prefill_kv_len(max(c.start + c.embeddings.shape[0] for c in chunks))
        from_start = all(chunk.start == 0 for chunk in chunks)
        # Graphs hold first chunks only (every prompt but one longer than `prefill_chunk` is one chunk).
        graph = self.prefill_graphs.get((rows, length, kv_len)) if from_start else None
        if graph is not None:
            graph.replay()
        else:
            self._prefill_step(rows, length, kv_len, from_start)

    @torch.no_grad()
    def decode(self, size: int, kv_len: int) -> None:
        """Launch one decode step over slots 0..size; each slot's token goes to `sampled[slot]`."""
        graph = self.decode_graphs.get((size, kv_len))
        if graph is not None:
            graph.replay()
        else:
            self._decode_step(size, kv_len)

    def read_back(self, prefill_rows: int, decode_rows: int) -> Readback:
        """Start copying the tokens of the calls launched so far to the host."""
        host, event = self.readbacks.start()
        return Readback(host, event, prefill_rows, decode_rows, self.prefill_sampled.numel())

    def synchronize(self) -> None:
        if self.config.torch_device.type == "cuda":
            torch.cuda.synchronize(self.config.torch_device)

    def _prefill_step(self, rows: int, length: int, kv_len: int, from_start: bool, layers: int | None = None
                      ) -> None:
        """One prefill call (`layers`: of the first layers only, a graph's warm-up; see Qwen2Model);
        `from_start`: every row's chunk starts its prompt (`CacheBatch.from_start`)."""
        slots, start, last, ends_prompt = self.prefill_rows[:, :rows]
        positions = start.unsqueeze(1) + torch.arange(length, device=start.device)
        batch = CacheBatch(slots, positions, kv_len, from_start)
        hidden = self.model.backbone(self.prefill_input[:rows, :length], batch, self.cache, layers)
        logits = self.model.speech_logits(hidden[torch.arange(rows, device=start.device), last])
        done = ends_prompt.bool()
        tokens = self.sampling.sample_and_record(logits, slots, done)
        self.next_token[slots] = torch.where(done, tokens, self.next_token[slots])
        self.active[slots] = self.active[slots] | done
        self.prefill_sampled[:rows] = tokens

    def _decode_step(self, size: int, kv_len: int, layers: int | None = None) -> None:
        """One decode step (`layers`: as for `_prefill_step`)."""
        rows = slice(0, size)
        active = self.active[rows]
        x = self.model.embed_speech(self.next_token[rows]).unsqueeze(1)
        logits = self.model(x, CacheBatch(0, self.positions[rows].unsqueeze(1), kv_len), self.cache, layers)
        tokens = self.sampling.sample_and_record(logits, rows, active)
        self.next_token[rows] = torch.where(active, tokens, self.next_token[rows])
        self.positions[rows] += active.long()
        self.sampled[rows] = tokens

