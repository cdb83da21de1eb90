"""The fused sampler (Triton, CUDA only) against sampling's definition: the uniforms of `draw_uniforms`
bit for bit, the tokens of the per-row reference (in float64, away from the cumulative boundaries where
the order of fp32 sums may decide), the state `record` leaves, and the eager sampler's tokens through
`SamplingSlots` over many steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_llm_sampling import HISTORY, IS_STOP, STOPS, peaked_logits, rows_for

from engines.config import SPEECH_EOS, SPEECH_VOCAB
from engines.llm.base import SamplingParams
from engines.llm.sampling import MAX_TOP_K, SamplingRows, SamplingSlots, draw_uniforms

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
triton = pytest.importorskip("triton")  # CUDA builds of torch bring it
tl = triton.language
sampling_kernel = pytest.importorskip("engines.llm.sampling_kernel")
CUDA = torch.device("cuda")
# Draws and top_p comparisons this close to a boundary may go either way between fp32 summation orders.
MARGIN = 1e-5
PARAMS = [
    SamplingParams(),
    SamplingParams(top_k=5, top_p=1.0, use_ras=False),
    SamplingParams(temperature=0.7, top_p=0.5, ras_window=4, ras_tau=0.5),
    SamplingParams(temperature=1.3, repetition_penalty=1.4, top_k=MAX_TOP_K, top_p=0.95),
    SamplingParams(top_k=1, fixed_length=50),
    SamplingParams(repetition_penalty=0.8, ras_window=16, ras_tau=0.2, top_p=0.99),
    SamplingParams(temperature=0.05, ras_window=2, ras_tau=0.5),
]


def reference(logits: torch.Tensor, p: SamplingParams, generated: list[int], min_len: int,
              uniforms: tuple[float, float]) -> tuple[int, float, bool]:
    """One row by sampling's definition in float64: (token, distance of the deciding comparisons from
    their boundaries relative to the mass they compare, whether RAS fell back)."""
    scores = logits.double().clone()
    for token in set(generated):
        scores[token] = scores[token] / p.repetition_penalty if scores[token] > 0 else (
            scores[token] * p.repetition_penalty)
    if len(generated) < min_len:
        scores[SPEECH_EOS] = float("-inf")
    if p.fixed_length is not None:
        scores[list(STOPS)] = float("-inf")
    scores = scores / p.temperature
    sorted_probs, sorted_ids = scores.softmax(0).sort(descending=True, stable=True)
    kept, mass, margin = 0, 0.0, float("inf")
    for prob in sorted_probs.tolist():
        if kept == p.top_k:
            break
        margin = min(margin, abs(mass - p.top_p))
        if mass >= p.top_p:
            break
        mass += prob
        kept += 1
    cumulative = sorted_probs[:kept].cumsum(0)
    target = uniforms[0] * cumulative[-1].item()
    picked = int((cumulative <= target).sum().clamp(max=kept - 1))
    margin = min(margin, (cumulative - target).abs().min().item() / cumulative[-1].item())
    candidate = int(sorted_ids[picked])
    if not p.use_ras or generated[-p.ras_window:].count(candidate) < p.ras_window * p.ras_tau:
        return candidate, margin, False
    scores[candidate] = float("-inf")
    cumulative = scores.softmax(0).cumsum(0)
    target = uniforms[1] * cumulative[-1].item()
    return int((cumulative <= target).sum()), min(margin, (cumulative - target).abs().min().item()), True


@triton.jit
def _draw(seed_ptr, step_ptr, out_ptr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0)
    seed, step = tl.load(seed_ptr + row), tl.load(step_ptr + row)
    tl.store(out_ptr + 2 * row, sampling_kernel._uniform(seed, step, 0))
    tl.store(out_ptr + 2 * row + 1, sampling_kernel._uniform(seed, step, 1))


def test_uniforms_are_draw_uniforms_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**32, (4096,), generator=generator).to(CUDA)
    steps = torch.cat([torch.arange(64), torch.randint(0, 2**33, (4032,), generator=generator)]).to(CUDA)
    out = torch.empty(4096, 2, device=CUDA)
    _draw[(4096,)](seeds, steps, out)
    assert torch.equal(out, draw_uniforms(seeds, steps))


def on_cuda(rows: SamplingRows) -> SamplingRows:
    return SamplingRows(**{name: value.to(CUDA, copy=True) for name, value in vars(rows).items()})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tokens_and_records_follow_the_definition(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    is_stop = IS_STOP.to(CUDA)
    compared, fallbacks, total = 0, 0, 0
    for trial in range(40):
        logits = peaked_logits(len(PARAMS), generator).to(dtype)
        logits[:, SPEECH_EOS] += 8.0 * (trial % 2)
        generated = [torch.randint(0, 40, (trial % 17,), generator=generator).tolist() for _ in PARAMS]
        min_lens = [trial % 7 for _ in PARAMS]
        rows = rows_for(PARAMS, generated, min_lens, [1000 * trial + row for row in range(len(PARAMS))])
        state = on_cuda(rows)
        active = torch.tensor([(row + trial) % 3 != 0 for row in range(len(PARAMS))])
        slots = torch.arange(len(PARAMS), device=CUDA)
        tokens = sampling_kernel.sample_and_record(logits.to(CUDA), slots, active.to(CUDA), state, is_stop,
                                                   SPEECH_EOS).cpu()
        uniforms = draw_uniforms(rows.seed, rows.step).tolist()
        for row, p in enumerate(PARAMS):
            expected, margin, fell_back = reference(logits[row].float(), p, generated[row], min_lens[row],
                                                    uniforms[row])
            total += 1
            fallbacks += fell_back
            if margin > MARGIN:
                assert tokens[row].item() == expected, (trial, row)
                compared += 1
            history, seen = rows.history[row], rows.seen[row].clone()
            if active[row]:
                history = torch.cat([history[1:], tokens[row:row + 1]])
                seen[tokens[row]] = True
            assert state.step[row].item() == rows.step[row].item() + int(active[row])
            assert torch.equal(state.history[row].cpu(), history)
            assert torch.equal(state.seen[row].cpu(), seen)
    assert compared >= 0.95 * total
    assert fallbacks > 0


def test_fused_slots_sample_what_the_eager_ones_do_over_many_steps() -> None:
    """`SamplingSlots` fused and eager on CUDA, 60 steps of 7 slots, alternately as consecutive slots
    (one idle) and gathered with padding rows on a scratch slot, as the engine's batches are: the same
    tokens and the same state. Without RAS: its fallback draws over the whole vocabulary, where the
    two implementations' fp32 scans may part by a token (the test above checks it against float64),
    and one different token makes every later step differ."""
    generator = torch.Generator().manual_seed(11)
    samplers = [SamplingSlots(9, SPEECH_VOCAB, HISTORY, STOPS, SPEECH_EOS, CUDA, fused=fused)
                for fused in (False, True)]
    params = [dataclasses.replace(p, use_ras=False) for p in PARAMS]
    for slots in samplers:
        slots.configure(torch.arange(7, device=CUDA), [(p, 4, 50 + i) for i, p in enumerate(params)])
    gathered = torch.tensor([6, 0, 1, 2, 3, 4, 5, 8, 8], device=CUDA)  # slot 8: a scratch slot, twice
    active = torch.tensor([False] + [True] * 6 + [False] * 2, device=CUDA)
    for step in range(60):
        rows, row_active = (gathered, active) if step % 2 else (slice(0, 7), active[[1, 2, 3, 4, 5, 6, 0]])
        logits = peaked_logits(len(row_active), generator).to(CUDA, torch.bfloat16)
        eager, fused = (slots.sample_and_record(logits, rows, row_active) for slots in samplers)
        assert torch.equal(fused[row_active], eager[row_active]), step
    for name in ("step", "history", "seen"):
        assert torch.equal(getattr(samplers[1].rows(slice(0, 9)), name),
                           getattr(samplers[0].rows(slice(0, 9)), name)), name
    assert samplers[1].rows(slice(6, 7)).step.item() == 0 and samplers[1].rows(slice(0, 1)).step.item() == 60


def test_a_top_k_above_the_limit_is_refused() -> None:
    slots = SamplingSlots(2, SPEECH_VOCAB, HISTORY, STOPS, SPEECH_EOS, CUDA, fused=True)
    with pytest.raises(ValueError, match="top_k"):
        slots.configure(torch.tensor([0], device=CUDA), [(SamplingParams(top_k=MAX_TOP_K + 1), 0, 1)])
