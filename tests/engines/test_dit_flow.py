"""Step-Audio2 DiT flow: strict loading, cached estimator steps, streaming against offline, bounded caches."""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import random
import weakref
from pathlib import Path

import pytest
import torch
from reference import reference_manifest
from weights import randomize

from engines.checkpoints import CheckpointError, load_strict, read_manifest_tsv
from engines.config import FlowConfig, ModelConfigs
from engines.token2wav.cfm import ConditionalCFM, cosine_time_grid
from engines.token2wav.conformer import blocks_attention_mask
from engines.token2wav.dit import DiT
from engines.token2wav.dit_cache import CacheRule, EstimatorKeys
from engines.token2wav.flow_dit import DiTFlow, DiTSpeaker, DiTStream, load_dit_flow
from engines.voice import VoicePrompt

MANIFEST = "step-audio-2-mini.token2wav.flow.pt.tsv"
TINY = ModelConfigs.tiny().dit_flow
LOOKAHEAD = TINY.encoder.pre_lookahead
PROMPT_TOKENS = 12



def tiny_flow(cfg: FlowConfig = TINY) -> DiTFlow:
    flow = DiTFlow(cfg).eval()
    randomize(flow, seed=0)
    return flow


@pytest.fixture(scope="module")
def flow() -> DiTFlow:
    return tiny_flow()


@pytest.fixture(scope="module")
def voice() -> VoicePrompt:
    generator = torch.Generator().manual_seed(1)
    return VoicePrompt(
        prompt_text="prompt",
        speech_tokens=torch.randint(0, TINY.vocab_size, (PROMPT_TOKENS,), generator=generator),
        speaker_embedding=torch.randn(192, generator=generator),
        prompt_mel=torch.randn(2 * PROMPT_TOKENS, 80, generator=generator),
    )


def utterance(voice: VoicePrompt, length: int, seed: int) -> torch.Tensor:
    """Tokens that start like the prompt: streaming's stand-in prompt lookahead (the prompt's first 3
    tokens) then equals the real one, so streaming and block-causal offline compute the same thing."""
    generator = torch.Generator().manual_seed(seed)
    rest = torch.randint(0, TINY.vocab_size, (length - LOOKAHEAD,), generator=generator)
    return torch.cat([voice.speech_tokens[:LOOKAHEAD], rest])


def stream_mel(flow: DiTFlow, stream: DiTStream, tokens: torch.Tensor, hops: list[int]) -> list[torch.Tensor]:
    """The chunk protocol: hop new tokens + 3 lookahead per chunk, then everything left."""
    mels, start = [], 0
    for hop in hops:
        mels.append(flow.chunk(stream, tokens[start:start + hop + LOOKAHEAD], last=False))
        start += hop
    mels.append(flow.chunk(stream, tokens[start:], last=True))
    return mels


# -- loading ------------------------------------------------------------------------------------------------


def test_full_config_state_dict_is_the_released_layout() -> None:
    entries = read_manifest_tsv(reference_manifest(MANIFEST))
    with torch.device("meta"):
        full = DiTFlow(ModelConfigs.full().dit_flow)
    assert [(name, tuple(t.shape)) for name, t in full.state_dict().items()] == entries
    load_strict(full, {name: torch.empty(shape, device="meta") for name, shape in entries}, "manifest")


def test_mismatched_checkpoint_is_rejected_by_name() -> None:
    entries = dict(read_manifest_tsv(reference_manifest(MANIFEST)))
    entries.pop("decoder.estimator.blocks.3.attn.q_norm.weight")
    entries["encoder_proj.weight"] = (80, 256)
    with torch.device("meta"):
        full = DiTFlow(ModelConfigs.full().dit_flow)
    state = {name: torch.empty(shape, device="meta") for name, shape in entries.items()}
    with pytest.raises(CheckpointError, match=r"blocks\.3\.attn\.q_norm\.weight") as error:
        load_strict(full, state, "flow.pt")
    assert "encoder_proj.weight: expected [80, 512], found [80, 256]" in str(error.value)


def test_load_dit_flow_round_trip(tmp_path: Path, flow: DiTFlow, voice: VoicePrompt) -> None:
    path = tmp_path / "flow.pt"
    torch.save(flow.state_dict(), path)
    loaded = load_dit_flow(path, TINY, "cpu", torch.float32)
    assert not loaded.training
    tokens = utterance(voice, 10, seed=2)
    torch.testing.assert_close(loaded.offline(loaded.prepare_speaker(voice), tokens),
                               flow.offline(flow.prepare_speaker(voice), tokens))
    with pytest.raises(ValueError, match="estimator_kind"):
        DiTFlow(dataclasses.replace(TINY, estimator_kind="unet"))


def test_conv_branch_weights_stay_tap_major_and_its_matmul_is_the_conv(tmp_path: Path, flow: DiTFlow) -> None:
    """The causal convs' weights are stored tap-major (the batched path reads each tap's matrix in
    place) through a save, a strict load and a dtype change; the batched path's matmul conv equals
    Conv1d in float64 with random biases, from that storage and from any other."""
    path = tmp_path / "flow.pt"
    torch.save(flow.state_dict(), path)
    loaded = load_dit_flow(path, TINY, "cpu", torch.float16)
    branch = loaded.decoder.estimator.blocks[0].conv
    for name in ("1", "6"):
        assert branch.block[name].weight.permute(2, 0, 1).is_contiguous()
    conv = copy.deepcopy(flow.decoder.estimator.blocks[0].conv.block["1"]).double()
    h = torch.randn(3, 9, conv.in_channels, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = conv(h.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(type(branch)._matmul_conv(conv, h), want, rtol=1e-12, atol=1e-12)
    conv.weight.data = conv.weight.data.contiguous()  # channel-major storage: the matmul copies, same sums
    torch.testing.assert_close(type(branch)._matmul_conv(conv, h), want, rtol=1e-12, atol=1e-12)


# -- estimator and solver ---------------------------------------------------------------------------------


def test_cached_steps_equal_the_uncached_forward() -> None:
    cfg = TINY.dit
    dit = DiT(cfg).eval()
    randomize(dit, seed=3)
    b, chunks = 2, [9, 1, 6]
    total = sum(chunks)
    x, mu, cond = (torch.randn(b, 80, total) for _ in range(3))
    spks, t = torch.randn(b, 80), torch.rand(b)
    cnn = torch.zeros(cfg.depth, b, 2 * cfg.hidden_size, 2)
    kv = torch.zeros(cfg.depth, b, cfg.num_heads, 0, 2 * cfg.head_dim)
    pieces, start = [], 0
    with torch.no_grad():
        for size in chunks:
            window = slice(start, start + size)
            v, cnn, new_kv = dit.forward_chunk(
                x[..., window], mu[..., window], t, spks, cond[..., window], cnn, kv)
            assert new_kv.shape == (cfg.depth, b, cfg.num_heads, size, 2 * cfg.head_dim)
            kv = torch.cat([kv, new_kv], dim=3)
            pieces.append(v)
            start += size
        block_causal = blocks_attention_mask(chunks)[None].expand(b, -1, -1)
        expected = dit(x, block_causal, mu, t, spks, cond)
        full = dit(x, torch.ones(b, 1, total, dtype=torch.bool), mu, t, spks, cond)
    assert cnn.shape == (cfg.depth, b, 2 * cfg.hidden_size, 2)
    torch.testing.assert_close(torch.cat(pieces, dim=2), expected, atol=1e-5, rtol=1e-5)
    # Without the block-causal mask, earlier frames would see later ones.
    assert (full[..., : chunks[0]] - pieces[0]).abs().max() > 1e-3


def test_cache_order_does_not_matter() -> None:
    """No positions in the DiT: the caller may keep shared prompt frames first and trim anywhere."""
    cfg = TINY.dit
    dit = DiT(cfg).eval()
    randomize(dit, seed=4)
    x, mu, cond = (torch.randn(1, 80, 5) for _ in range(3))
    spks, t = torch.randn(1, 80), torch.rand(1)
    cnn = torch.randn(cfg.depth, 1, 2 * cfg.hidden_size, 2)
    kv = torch.randn(cfg.depth, 1, cfg.num_heads, 7, 2 * cfg.head_dim)
    with torch.no_grad():
        v, _, _ = dit.forward_chunk(x, mu, t, spks, cond, cnn, kv)
        shuffled, _, _ = dit.forward_chunk(x, mu, t, spks, cond, cnn, kv[:, :, :, torch.randperm(7)])
    torch.testing.assert_close(v, shuffled, atol=1e-5, rtol=1e-5)


def test_time_grid_and_seeded_noise() -> None:
    grid = cosine_time_grid(10)
    assert grid[0] == 0.0 and grid[-1] == pytest.approx(1.0)
    assert grid[1] == pytest.approx(1 - math.cos(math.pi / 20))
    assert all(b - a < d - c for a, b, c, d in zip(grid, grid[1:], grid[1:], grid[2:], strict=False))
    first = ConditionalCFM(torch.nn.Identity(), 10, 0.7, noise_frames=50, seed=0)
    second = ConditionalCFM(torch.nn.Identity(), 10, 0.7, noise_frames=50, seed=0)
    assert torch.equal(first.noise, second.noise)
    wrapped = torch.cat([first.noise[:, :, 45:], first.noise[:, :, :5]], dim=2)
    assert torch.equal(first.noise_at(45, 10), wrapped)
    with pytest.raises(TypeError, match="no cached chunk mode"):
        first.solve_chunk(torch.zeros(1, 80, 2), torch.zeros(1, 80), torch.zeros(1, 80, 2), 0,
                          torch.zeros(10), None, torch.zeros(10))


# -- streaming ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hops", [[15, 25], [4, 4, 4], []], ids=["15+25", "equal_4", "single_chunk"])
def test_streaming_equals_block_causal_offline(flow: DiTFlow, voice: VoicePrompt, hops: list[int]) -> None:
    """Same model, same noise columns, same attention pattern → the same mel up to fp32 rounding.

    Plain `offline` lets every frame attend to later chunks too, which the causal streaming model
    cannot see; with chunk_layout it restricts attention to what each chunk saw. The remaining
    differences are reassociation in rectangular vs square matmuls over 10 Euler steps (~1e-6).
    """
    tokens = utterance(voice, 47, seed=5)
    speaker = flow.prepare_speaker(voice)
    stream = flow.open_stream(speaker)
    mels = stream_mel(flow, stream, tokens, hops)
    assert [m.shape[2] for m in mels] == [2 * h for h in hops] + [2 * (tokens.numel() - sum(hops))]
    streamed = torch.cat(mels, dim=2)
    offline = flow.offline(speaker, tokens, chunk_layout=[*hops, tokens.numel() - sum(hops)])
    assert offline.shape == (1, 80, 2 * tokens.numel())
    torch.testing.assert_close(streamed, offline, atol=1e-4, rtol=1e-4)
    if hops:
        full = flow.offline(speaker, tokens)
        assert (full[..., : 2 * hops[0]] - streamed[..., : 2 * hops[0]]).abs().max() > 1e-4


def test_streams_share_the_prompt_state_without_copying(flow: DiTFlow, voice: VoicePrompt) -> None:
    speaker = flow.prepare_speaker(voice)
    prompt_kv = speaker.estimator_kv.clone()
    assert speaker.estimator_kv.shape[4] == 2 * PROMPT_TOKENS
    first, second = flow.open_stream(speaker), flow.open_stream(speaker)
    assert first.nbytes < speaker.nbytes / 4  # own caches only
    tokens = utterance(voice, 20, seed=6)
    a = flow.chunk(first, tokens[:13], last=False)
    b = flow.chunk(second, tokens[:13], last=False)
    torch.testing.assert_close(a, b)
    assert first.estimator_kv.shape[4] == 20 and first.encoder.num_tokens == 10
    assert torch.equal(speaker.estimator_kv, prompt_kv)
    first.close()
    first.close()
    assert first.nbytes == 0
    with pytest.raises(ValueError, match="open DiTStream"):
        flow.chunk(first, tokens[10:], last=True)
    assert flow.chunk(second, tokens[10:], last=True).shape == (1, 80, 20)


def test_chunk_protocol_errors_and_empty_final_chunk(flow: DiTFlow, voice: VoicePrompt) -> None:
    stream = flow.open_stream(flow.prepare_speaker(voice))
    with pytest.raises(ValueError, match="more than 3 tokens"):
        flow.chunk(stream, torch.tensor([1, 2, 3]), last=False)
    assert flow.chunk(stream, torch.zeros(0, dtype=torch.long), last=True).shape == (1, 80, 0)


def reference_stream(flow: DiTFlow, speaker: DiTSpeaker, tokens: torch.Tensor,
                     hops: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Step-Audio2's streaming driver, from its definition (MODEL_FACTS §5.5), on the flow's modules.

    One cache tensor per Euler step holding every kept key in the reference's order: each step's new
    keys go *before* the cached ones; after each chunk, a cache longer than L_p + R becomes its slices
    [:L_p] and [-R:] ("reference"); or, kept in time order, the prompt plus the R newest frames
    ("prompt_recent"). A chunk's
    noise is the buffer's columns from the cache length ("reference") or from its utterance frame.
    Returns the chunks' mels and the cache length after each chunk.
    """
    cfg, cfm, dit = flow.cfg, flow.decoder, flow.decoder.estimator
    prompt, recent = speaker.prompt_frames, cfg.att_cache_recent_frames
    att = speaker.estimator_kv.clone()  # after setup: the prompt's keys, in time order
    cnn = speaker.estimator_cnn
    encoder = speaker.encoder
    generated = 0
    mels, lengths = [], []
    pieces = [(tokens[sum(hops[:k]): sum(hops[:k + 1]) + LOOKAHEAD], False) for k in range(len(hops))]
    pieces.append((tokens[sum(hops):], True))
    with torch.no_grad():
        for piece, last in pieces:
            encoded, update = flow.encoder.forward_chunk(flow.input_embedding(piece)[None], encoder, last)
            encoder = encoder.extend(update)  # never trimmed
            mu = flow.encoder_proj(encoded).transpose(1, 2)
            frames = mu.shape[2]
            offset = att.shape[4] if cfg.att_cache_rule == "reference" else prompt + generated
            x = cfm.noise[:, :, offset: offset + frames].clone()
            new_att, new_cnn = [], []
            for step in range(cfg.n_timesteps):
                t = torch.full((2,), cfm.t_grid[step])
                v, step_cnn, chunk_kv = dit.forward_chunk(
                    torch.cat([x, x]), torch.cat([mu, torch.zeros_like(mu)]), t,
                    torch.cat([speaker.spks, torch.zeros_like(speaker.spks)]), torch.zeros(2, 80, frames),
                    cnn[step], att[step])
                if cfg.att_cache_rule == "reference":
                    new_att.append(torch.cat([chunk_kv, att[step]], dim=3))  # new keys first
                else:  # time order: the prompt, then the generated frames
                    new_att.append(torch.cat([att[step], chunk_kv], dim=3))
                new_cnn.append(step_cnn)
                v_cond, v_uncond = v.chunk(2)
                guided = (1 + cfg.cfg_rate) * v_cond - cfg.cfg_rate * v_uncond
                x = x + (cfm.t_grid[step + 1] - cfm.t_grid[step]) * guided
            att, cnn = torch.stack(new_att), torch.stack(new_cnn)
            generated += frames
            if att.shape[4] > prompt + recent:
                if cfg.att_cache_rule == "reference":
                    att = torch.cat([att[..., :prompt, :], att[..., att.shape[4] - recent:, :]], dim=4)
                else:
                    att = torch.cat([att[..., :prompt, :], att[..., att.shape[4] - recent:, :]], dim=4)
            mels.append(x)
            lengths.append(att.shape[4])
    return mels, lengths


TRIM_CASES = {
    # R < L_p = 24: the kept tail is the prompt's last R frames; hops shorter and longer than L_p.
    "R10": (10, [4, 3, 5, 2, 6, 4, 15, 3, 5]),
    # R > L_p: the kept tail holds the whole prompt and the oldest generated frames.
    "R40": (40, [6, 5, 7, 4, 9, 5, 6, 3]),
}


@pytest.mark.parametrize("rule", ["reference", "prompt_recent"])
@pytest.mark.parametrize("case", list(TRIM_CASES), ids=list(TRIM_CASES))
def test_streaming_equals_the_reference_driver_across_trims(voice: VoicePrompt, rule: str, case: str) -> None:
    """Ours keeps the prompt once per voice and a stream's own frames apart, in time order, and selects
    by index; the driver above concatenates and slices as the reference does. Same kept set and noise
    → the same mel; only the order of the softmax sums differs (~1e-7)."""
    recent, hops = TRIM_CASES[case]
    model = tiny_flow(dataclasses.replace(TINY, att_cache_recent_frames=recent, att_cache_rule=rule))
    tokens = utterance(voice, sum(hops) + 9, seed=11)
    speaker = model.prepare_speaker(voice)
    stream = model.open_stream(speaker)
    want, lengths = reference_stream(model, speaker, tokens, hops)
    got, attended = [], []
    starts = [sum(hops[:k]) for k in range(len(hops) + 1)]
    for k, start in enumerate(starts):
        last = k == len(hops)
        piece = tokens[start:] if last else tokens[start: start + hops[k] + LOOKAHEAD]
        got.append(model.chunk(stream, piece, last))
        kept_prompt = stream.keys.prompt
        attended.append(stream.estimator_kv.shape[4]
                        + (2 * PROMPT_TOKENS if kept_prompt is None else len(kept_prompt)))
    assert attended == lengths
    prompt = 2 * PROMPT_TOKENS
    trims = sum(1 for before, after in zip([prompt, *lengths], lengths, strict=False) if after <= before)
    assert trims >= 4  # the cache was trimmed again and again
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    if rule == "reference":
        assert max(lengths) == prompt + recent


@pytest.mark.parametrize("rule", ["reference", "prompt_recent"])
def test_keys_worked_out_once_equal_fresh_ones_whatever_is_asked_in_between(rule: CacheRule) -> None:
    """Keys keep their latest successor (streams in step share it); asking for another chunk length
    replaces it, and every answer equals one worked out from scratch."""
    rng = random.Random(3)

    def fresh(keys: EstimatorKeys) -> EstimatorKeys:
        return EstimatorKeys(keys.rule, keys.recent, keys.prompt_frames, keys.generated, keys.order)

    keys = EstimatorKeys.start(rule, 20, 30)
    for _ in range(40):
        frames = rng.choice([2, 30, 50, 100, rng.randint(1, 120)])
        other = rng.randint(1, 120)
        after, detour = keys.after_chunk(frames), keys.after_chunk(other)
        assert keys.after_chunk(frames) == fresh(keys).after_chunk(frames) == after
        assert keys.kept_positions(detour) == fresh(keys).kept_positions(fresh(detour))
        assert keys.kept_positions(after) == fresh(keys).kept_positions(fresh(after))
        held = keys.after_chunk(frames)
        assert keys.after_chunk(frames) is held  # shared by the streams in step
        assert (after.prompt, after.own) == (fresh(after).prompt, fresh(after).own)
        keys = after
    # Held weakly: once no stream holds its successor, a keys object keeps none of the chain.
    successor = weakref.ref(keys.after_chunk(7))
    gc.collect()
    assert successor() is None


def test_reference_rule_keeps_the_newest_chunks_first_frames_and_a_fixed_tail() -> None:
    """The rule on frame numbers: L_p = 6, R = 4, chunks of 3, 5 and 8 frames."""
    keys = EstimatorKeys.start("reference", 4, 6)
    assert keys.noise_offset == 6 and keys.prompt is None and keys.own == ()
    keys = keys.after_chunk(3)  # 9 ≤ 10 keys: nothing dropped
    assert keys.order == (6, 7, 8, 0, 1, 2, 3, 4, 5) and keys.noise_offset == 9
    keys = keys.after_chunk(5)  # 14 keys: the first 6 (the new chunk, then frame 6) and the last 4
    assert keys.order == (9, 10, 11, 12, 13, 6, 2, 3, 4, 5)
    assert keys.prompt == (2, 3, 4, 5) and keys.own == (6, 9, 10, 11, 12, 13) and keys.noise_offset == 10
    before = keys
    keys = keys.after_chunk(8)  # a chunk longer than L_p keeps its first 6 frames
    assert keys.order == (14, 15, 16, 17, 18, 19, 2, 3, 4, 5) and keys.generated == 16
    assert before.kept_positions(keys) == (6, 7, 8, 9, 10, 11)  # in [6 own, 8 new]
    recent = EstimatorKeys.start("prompt_recent", 4, 6).after_chunk(3).after_chunk(5)
    assert recent.prompt is None and recent.own == (10, 11, 12, 13) and recent.noise_offset == 14
    with pytest.raises(ValueError, match="unknown estimator cache rule"):
        EstimatorKeys.start("newest", 4, 6)  # type: ignore[arg-type]


def test_encoder_cache_is_never_trimmed_up_to_the_position_table(voice: VoicePrompt) -> None:
    """As in the reference: every token's keys stay; past the table the chunk is refused clearly."""
    table = 2 * (PROMPT_TOKENS + 30)  # 30 stream tokens fit at the mel rate
    model = tiny_flow(dataclasses.replace(TINY, encoder=dataclasses.replace(TINY.encoder,
                                                                            max_relative_len=table)))
    stream = model.open_stream(model.prepare_speaker(voice))
    tokens = utterance(voice, 40, seed=12)
    for k in range(5):
        model.chunk(stream, tokens[6 * k: 6 * k + 6 + LOOKAHEAD], last=False)
        assert stream.encoder.num_tokens == 6 * (k + 1)
    with pytest.raises(ValueError, match="exceeds the position table"):
        model.chunk(stream, tokens[30:36 + LOOKAHEAD], last=False)


def test_bfloat16_flow_tracks_float32(flow: DiTFlow, voice: VoicePrompt) -> None:
    """Half precision as deployed: time features stay fp32 inside, so only bf16 rounding (2⁻⁸ relative
    per op) separates the two; over 10 Euler steps it stays within a few hundredths of mel values ~5."""
    half = tiny_flow().to(torch.bfloat16)
    tokens = utterance(voice, 20, seed=8)
    mels = []
    for model in (flow, half):
        stream = model.open_stream(model.prepare_speaker(voice))
        mels.append(torch.cat(stream_mel(model, stream, tokens, [10]), dim=2))
    assert mels[1].dtype == torch.bfloat16
    torch.testing.assert_close(mels[1].float(), mels[0], atol=0.15, rtol=0.02)
