"""The most device bytes one streaming DiT token2wav stream holds between its chunks (admission's bound).

A stream's own state (flow_dit.DiTStream, hift_stream.HiFTStream; the voice's prompt caches are shared
and held once per voice) is, with itemsize the flow's dtype:

- estimator keys/values of its own kept frames: u · own_max, u = steps · depth · 2 (guidance) · heads ·
  2 · head_dim · itemsize (640 KiB at full size in fp16, as solve_memory.py's u). Under the reference
  rule (dit_cache.py) the cache holds at most L_p + R frames, of which the prompt's entries sit at the
  tail once trimming begins: the own frames are at most R before the first trim and then L_p (the head)
  or, when L_p < R, R (the tail's generated frames), so own_max = max(L_p, R); under `prompt_recent` R;
- estimator conv contexts: steps · depth · 2 · 2 · hidden · 2 · itemsize (1.25 MiB at full size);
- encoder: its two conv contexts, and keys/values of every token of the stream (never trimmed, as in
  the reference): (num_blocks + up_stride · num_up_blocks) · heads · 2 · head_dim · itemsize per token
  (28 KiB at full size), for at most `max_tokens` tokens (the LLM's context bounds a request's tokens);
- vocoder: the last mel_cache_frames mel frames, source_cache_samples source samples and speech tail
  samples, float32.

At full size with the default voice (a 4 s clip: L_p = 200 frames) and 2048 tokens this is 182 MiB,
above the 134–172 MiB per stream measured on an H100 (docs/benchmarks.md: those include the batches'
working memory, but not utterances of 2048 tokens). The working memory of a chunk (the solve's
transient tensors, the [own, chunk] cache before its trim) is the solve budget's (solve_memory.py), not
this bound's. The vocoder's cached tails are rows of one small copy per call
(hift_stream.vocode_streams: the call's last mel frames, source and speech samples), not views of its
outputs.
"""

from __future__ import annotations

from engines.config import FlowConfig, HiFTConfig
from engines.token2wav.conformer import PRE_LOOKAHEAD_LEFT, UPSAMPLE_KERNEL_GROWTH
from engines.token2wav.dit_cache import CacheRule, cached_frame_elements

FLOAT32_BYTES = 4


def most_own_frames(rule: CacheRule, recent: int, prompt_frames: int) -> int:
    """The most generated frames a stream's estimator cache keeps after any chunk (module docstring)."""
    return max(prompt_frames, recent) if rule == "reference" else recent


def stream_state_bytes(flow: FlowConfig, hift: HiFTConfig, itemsize: int, prompt_frames: int,
                       max_tokens: int) -> int:
    """The most bytes one stream of a voice with `prompt_frames` prompt frames holds between chunks, over
    at most `max_tokens` speech tokens, with the flow's tensors `itemsize` bytes per element."""
    dit, enc, steps = flow.dit, flow.encoder, flow.n_timesteps
    own = most_own_frames(flow.att_cache_rule, flow.att_cache_recent_frames, prompt_frames)
    estimator_kv = cached_frame_elements(steps, dit.depth, dit.num_heads, dit.head_dim) * own
    estimator_cnn = steps * dit.depth * 2 * 2 * dit.hidden_size * 2
    encoder_convs = enc.d_model * (PRE_LOOKAHEAD_LEFT + UPSAMPLE_KERNEL_GROWTH * enc.up_stride)
    encoder_kv = (enc.num_blocks + enc.up_stride * enc.num_up_blocks) * enc.num_heads * 2 * enc.head_dim
    vocoder = FLOAT32_BYTES * (hift.in_channels * hift.mel_cache_frames + 2 * hift.source_cache_samples)
    return itemsize * (estimator_kv + estimator_cnn + encoder_convs + encoder_kv * max_tokens) + vocoder
