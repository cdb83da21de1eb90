"""Batched sampling against a straightforward per-row computation, and its documented behaviours."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.config import SPEECH_EOS, SPEECH_FILL, SPEECH_UNUSED_STOP, SPEECH_VOCAB
from engines.llm.base import SamplingParams
from engines.llm.sampling import SamplingRows, SamplingSlots, draw_uniforms, ras_threshold, sample
from engines.precompiled import PrecompiledFunction, supported

STOPS = (SPEECH_EOS, SPEECH_UNUSED_STOP, SPEECH_FILL)
HISTORY = 16
IS_STOP = torch.zeros(SPEECH_VOCAB, dtype=torch.bool)
IS_STOP[list(STOPS)] = True


def rows_for(params: list[SamplingParams], generated: list[list[int]], min_lens: list[int],
             seeds: list[int]) -> SamplingRows:
    """Rows as the engine holds them, built directly from plain lists."""
    history = torch.full((len(params), HISTORY), -1, dtype=torch.int64)
    seen = torch.zeros(len(params), SPEECH_VOCAB, dtype=torch.bool)
    for row, tokens in enumerate(generated):
        recent = tokens[-HISTORY:]
        if recent:
            history[row, HISTORY - len(recent):] = torch.tensor(recent)
            seen[row, tokens] = True
    return SamplingRows(
        temperature=torch.tensor([p.temperature for p in params]),
        top_k=torch.tensor([p.top_k for p in params]),
        top_p=torch.tensor([p.top_p for p in params]),
        repetition_penalty=torch.tensor([p.repetition_penalty for p in params]),
        ras_threshold=torch.tensor([ras_threshold(p) if p.use_ras else HISTORY + 1 for p in params]),
        ras_window=torch.tensor([p.ras_window for p in params]),
        min_len=torch.tensor(min_lens),
        ignore_stop=torch.tensor([p.fixed_length is not None for p in params]),
        seed=torch.tensor(seeds),
        step=torch.tensor([len(tokens) for tokens in generated]),
        history=history,
        seen=seen,
    )


def first_above(cumulative: torch.Tensor, target: float) -> int:
    for index, value in enumerate(cumulative.tolist()):
        if value > target:
            return index
    return len(cumulative) - 1


def reference_sample(logits: torch.Tensor, p: SamplingParams, generated: list[int], min_len: int,
                     u_nucleus: float, u_full: float) -> tuple[int, bool]:
    """One row, the way MODEL_FACTS §3.3-3.4 describes it, with explicit loops: (token, RAS fell back)."""
    scores = logits.clone().float()
    for token in set(generated):
        value = scores[token]
        scores[token] = value / p.repetition_penalty if value > 0 else value * p.repetition_penalty
    if len(generated) < min_len:
        scores[SPEECH_EOS] = float("-inf")
    if p.fixed_length is not None:
        scores[list(STOPS)] = float("-inf")
    scores = scores / p.temperature
    sorted_probs, sorted_ids = scores.softmax(dim=0).sort(descending=True, stable=True)
    kept, mass = [], 0.0
    for prob in sorted_probs.tolist():
        if mass < p.top_p and len(kept) < p.top_k:
            mass += prob
            kept.append(prob)
        else:
            break
    kept_probs = torch.tensor(kept)
    cumulative = kept_probs.cumsum(dim=0)
    candidate = int(sorted_ids[first_above(cumulative, u_nucleus * cumulative[-1].item())])
    if p.use_ras and generated[-p.ras_window:].count(candidate) >= p.ras_window * p.ras_tau:
        scores[candidate] = float("-inf")
        cumulative = scores.softmax(dim=0).cumsum(dim=0)
        return first_above(cumulative, u_full * cumulative[-1].item()), True
    return candidate, False


def peaked_logits(rows: int, generator: torch.Generator) -> torch.Tensor:
    """Logits with a few dominant tokens, so nucleus sets are small and repeats are likely."""
    logits = torch.randn(rows, SPEECH_VOCAB, generator=generator)
    favourites = torch.randint(0, 40, (rows, 6), generator=generator)
    logits.scatter_add_(1, favourites, torch.full((rows, 6), 6.0))
    return logits


def test_batched_sampling_matches_the_per_row_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    params = [
        SamplingParams(),
        SamplingParams(top_k=5, top_p=1.0, use_ras=False),
        SamplingParams(temperature=0.7, top_p=0.5, ras_window=4, ras_tau=0.5),
        SamplingParams(temperature=1.3, repetition_penalty=1.4, top_k=100, top_p=0.95),
        SamplingParams(top_k=1, fixed_length=50),
        SamplingParams(repetition_penalty=0.8, ras_window=16, ras_tau=0.2),
    ]
    checked, fallbacks = 0, 0
    for trial in range(20):
        logits = peaked_logits(len(params), generator)
        logits[:, SPEECH_EOS] += 8.0 * (trial % 2)
        generated = [torch.randint(0, 40, (trial % 13,), generator=generator).tolist() for _ in params]
        min_lens = [trial % 7 for _ in params]
        seeds = [1000 * trial + row for row in range(len(params))]
        rows = rows_for(params, generated, min_lens, seeds)
        tokens = sample(logits, rows, IS_STOP, SPEECH_EOS).tolist()
        uniforms = draw_uniforms(rows.seed, rows.step).tolist()
        for row, p in enumerate(params):
            u_nucleus, u_full = uniforms[row]
            expected, fell_back = reference_sample(logits[row], p, generated[row], min_lens[row], u_nucleus,
                                                   u_full)
            assert tokens[row] == expected, (trial, row)
            checked += 1
            fallbacks += fell_back
    assert checked == 120 and 0 < fallbacks < checked


def plain(top_k: int = 25, top_p: float = 1.0, **kwargs: object) -> SamplingParams:
    return SamplingParams(top_k=top_k, top_p=top_p, use_ras=False, **kwargs)  # type: ignore[arg-type]


def sample_many(logits: torch.Tensor, p: SamplingParams, draws: int, generated: list[int] | None = None,
                min_len: int = 0) -> list[int]:
    """`draws` samples of one logits row, each with its own seed (one batch)."""
    rows = rows_for([p] * draws, [generated or []] * draws, [min_len] * draws, list(range(draws)))
    return sample(logits.expand(draws, -1), rows, IS_STOP, SPEECH_EOS).tolist()


def test_top_k_and_top_p_limit_the_candidates() -> None:
    logits = torch.full((SPEECH_VOCAB,), -10.0)
    logits[[10, 11, 12, 13, 14]] = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert set(sample_many(logits, plain(top_k=3), 400)) == {10, 11, 12}
    probs = logits.softmax(dim=0)
    # Token 10 alone holds less than 0.7, so the crossing token 11 is included, and nothing after it.
    assert probs[10] < 0.7 < probs[10] + probs[11]
    assert set(sample_many(logits, plain(top_p=0.7), 400)) == {10, 11}
    assert set(sample_many(logits, plain(top_p=float(probs[10]) * 0.99), 50)) == {10}


def test_ras_masks_a_repeated_candidate_and_samples_the_full_distribution() -> None:
    logits = torch.full((SPEECH_VOCAB,), -10.0)
    logits[[10, 11, 12]] = torch.tensor([6.0, 1.0, 1.0])
    nucleus = SamplingParams(top_k=1)  # the candidate is always token 10
    assert set(sample_many(logits, nucleus, 100, generated=[3, 4])) == {10}
    repeated = sample_many(logits, nucleus, 400, generated=[10, 3, 4])
    assert 10 not in repeated and {11, 12} <= set(repeated)  # full distribution, not only the top-k
    # Outside the window the repetition does not count.
    assert set(sample_many(logits, SamplingParams(top_k=1, ras_window=2), 100, generated=[10, 3, 4])) == {10}
    # With tau 0.5 over a window of 4, one occurrence is not enough but two are.
    sparse = SamplingParams(top_k=1, ras_window=4, ras_tau=0.5)
    assert set(sample_many(logits, sparse, 100, generated=[10, 3, 4])) == {10}
    assert 10 not in sample_many(logits, sparse, 100, generated=[10, 3, 10])


def test_eos_is_masked_below_min_length_and_stops_for_fixed_length() -> None:
    logits = torch.full((SPEECH_VOCAB,), -10.0)
    logits[SPEECH_EOS] = 5.0
    logits[SPEECH_UNUSED_STOP] = 4.0
    logits[7] = 0.0
    # Below the minimum only eos is banned (the other stop tokens stay possible, as in CosyVoice2).
    greedy = plain(top_k=1)
    assert set(sample_many(logits, greedy, 50, generated=[1, 2], min_len=3)) == {SPEECH_UNUSED_STOP}
    assert set(sample_many(logits, greedy, 50, generated=[1, 2, 3], min_len=3)) == {SPEECH_EOS}
    assert set(sample_many(logits, plain(fixed_length=10), 200, generated=[1, 2, 3])) == {7}


def test_uniforms_are_in_range_and_well_spread() -> None:
    seeds = torch.arange(20000)
    u = draw_uniforms(seeds, torch.full_like(seeds, 3))
    assert u.shape == (20000, 2) and u.min() >= 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    assert abs(u.var().item() - 1 / 12) < 0.003
    assert abs(torch.corrcoef(u.T)[0, 1].item()) < 0.03
    later = draw_uniforms(seeds, torch.full_like(seeds, 4))
    assert abs(torch.corrcoef(torch.stack((u[:, 0], later[:, 0])))[0, 1].item()) < 0.03


def run_slots(slots: SamplingSlots, configured: list[int], logits_for: dict[int, list[torch.Tensor]],
              size: int, steps: int, active: list[bool]) -> dict[int, list[int]]:
    """Sample and record `steps` times over slots 0..size; tokens of the `configured` slots."""
    out: dict[int, list[int]] = {slot: [] for slot in configured}
    for step in range(steps):
        logits = torch.zeros(size, SPEECH_VOCAB)
        for slot in configured:
            logits[slot] = logits_for[slot][step]
        tokens = slots.sample(logits, slice(0, size))
        slots.record(tokens, slice(0, size), torch.tensor(active))
        for slot in configured:
            out[slot].append(int(tokens[slot]))
    return out


def test_a_seeded_row_samples_the_same_tokens_alone_or_batched() -> None:
    generator = torch.Generator().manual_seed(1)
    params = [
        SamplingParams(seed=7), SamplingParams(seed=8, top_p=0.95), SamplingParams(seed=7, use_ras=False),
    ]
    steps = 30
    logits_for = {slot: list(peaked_logits(steps, generator)) for slot in range(3)}

    def new_slots() -> SamplingSlots:
        return SamplingSlots(4, SPEECH_VOCAB, HISTORY, STOPS, SPEECH_EOS, torch.device("cpu"))

    batched = new_slots()
    for slot, p in enumerate(params):
        batched.configure(torch.tensor([slot]), [(p, 5, p.seed or 0)])
    # Slot 3 is an idle row in the batch: it is sampled but never recorded.
    together = run_slots(batched, [0, 1, 2], logits_for, 4, steps, [True, True, True, False])
    assert batched.rows(slice(3, 4)).step.item() == 0
    assert batched.rows(slice(0, 1)).step.item() == steps
    for slot, p in enumerate(params):
        alone = new_slots()
        alone.configure(torch.tensor([0]), [(p, 5, p.seed or 0)])
        tokens = run_slots(alone, [0], {0: logits_for[slot]}, 1, steps, [True])[0]
        assert tokens == together[slot]
    assert together[0] != together[2]  # same seed, different rule: RAS changes the outcome here


def test_gathered_slots_sample_and_record_like_consecutive_ones() -> None:
    generator = torch.Generator().manual_seed(3)
    logits = peaked_logits(2, generator)
    consecutive, gathered = (SamplingSlots(4, SPEECH_VOCAB, HISTORY, STOPS, SPEECH_EOS, torch.device("cpu"))
                             for _ in range(2))
    for slots, slot_ids in ((consecutive, (1, 2)), (gathered, (2, 3))):
        slots.configure(torch.tensor(slot_ids), [(SamplingParams(), 0, 5), (SamplingParams(), 0, 6)])
    for _ in range(12):
        expected = consecutive.sample(logits, slice(1, 3))
        consecutive.record(expected, slice(1, 3), torch.tensor([True, True]))
        # Row order differs, and two inactive padding rows name slot 0.
        index = torch.tensor([3, 0, 2, 0])
        tokens = gathered.sample(logits[[1, 0, 0, 0]], index)
        gathered.record(tokens, index, torch.tensor([True, False, True, False]))
        assert tokens[[2, 0]].tolist() == expected.tolist()
    state, expected_state = gathered.rows(slice(2, 4)), consecutive.rows(slice(1, 3))
    for name in ("step", "history", "seen"):
        assert torch.equal(getattr(state, name), getattr(expected_state, name))
    assert gathered.rows(slice(0, 1)).step.item() == 0



@pytest.mark.skipif(not supported(), reason="this torch has no ahead-of-time compile")
def test_kept_uniforms_sample_what_eager_ones_do_and_a_second_sampler_compiles_none(tmp_path: Path) -> None:
    """The sampler's compiled uniforms kept ahead of time (`precompiled`, as the LLM engine's compile
    cache): the tokens of the eager sampler; a second sampler over the folder loads the variants and
    compiles none; sealed, a sampler compiles no more."""
    cpu = torch.device("cpu")
    generator = torch.Generator().manual_seed(7)
    params = [SamplingParams(), SamplingParams(top_k=5, top_p=1.0, use_ras=False)]
    samplers = [SamplingSlots(4, SPEECH_VOCAB, HISTORY, STOPS, SPEECH_EOS, cpu, compiled=compiled,
                              precompiled=tmp_path if compiled else None)
                for compiled in (False, True, True)]
    for slots in samplers:
        slots.configure(torch.tensor([0, 1]), [(p, 3, 100 + i) for i, p in enumerate(params)])
    for _ in range(4):
        logits = peaked_logits(2, generator)
        tokens = [slots.sample(logits, slice(0, 2)) for slots in samplers]
        assert torch.equal(tokens[1], tokens[0]) and torch.equal(tokens[2], tokens[0])
        for slots in samplers:
            slots.record(tokens[0], slice(0, 2), torch.ones(2, dtype=torch.bool))
    compiling, loading = (slots._draw_uniforms for slots in samplers[1:])
    assert isinstance(compiling, PrecompiledFunction) and isinstance(loading, PrecompiledFunction)
    assert compiling.compiled >= 1 and loading.compiled == 0 and loading.variants == compiling.compiled
    samplers[2].seal()
    loading(torch.tensor([1]), torch.tensor([2]))  # one row: a class of its own, run uncompiled once sealed
    assert loading.compiled == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_sampler_draws_the_same_uniforms_and_tokens_on_cuda() -> None:
    """The CUDA engine's sampler (uniforms from one Inductor kernel) equals the eager one exactly."""
    cuda = torch.device("cuda")
    generator = torch.Generator().manual_seed(5)
    seeds = torch.randint(0, 2**32, (4096,), generator=generator).to(cuda)
    steps = torch.randint(0, 5000, (4096,), generator=generator).to(cuda)
    compiled = torch.compile(draw_uniforms, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(seeds, steps), draw_uniforms(seeds, steps))

    samplers = [SamplingSlots(8, SPEECH_VOCAB, HISTORY, STOPS, SPEECH_EOS, cuda, compiled=compiled)
                for compiled in (False, True)]
    params = [SamplingParams(), SamplingParams(top_k=5, top_p=1.0, use_ras=False),
              SamplingParams(temperature=0.7, top_p=0.5, ras_window=4, ras_tau=0.5)]
    for slots in samplers:
        slots.configure(torch.tensor([0, 1, 2], device=cuda), [(p, 3, 100 + i) for i, p in enumerate(params)])
    for _ in range(20):
        logits = peaked_logits(3, generator).to(cuda)
        tokens = [slots.sample(logits, slice(0, 3)) for slots in samplers]
        assert torch.equal(tokens[1], tokens[0])
        for slots in samplers:
            slots.record(tokens[0], slice(0, 3), torch.ones(3, dtype=torch.bool, device=cuda))


def test_configure_sets_each_slot_s_fields_and_resets_its_state() -> None:
    """A slot reused by a new request gets that request's settings in every field (the fields are rows of
    shared tables), its history and seen tokens are cleared, and the other slots keep theirs."""
    slots = SamplingSlots(3, SPEECH_VOCAB, HISTORY, STOPS, SPEECH_EOS, torch.device("cpu"))
    before = slots.rows(slice(0, 3))
    first = SamplingParams(temperature=0.7, top_k=9, top_p=0.6, repetition_penalty=1.3, use_ras=True,
                           ras_window=7, ras_tau=0.25, fixed_length=12)
    second = SamplingParams(temperature=1.1, top_k=3, top_p=0.9, use_ras=False)
    slots.configure(torch.tensor([2, 0]), [(first, 11, 2**32 + 5), (second, 4, 77)])
    slots.record(torch.tensor([3, 4, 5]), slice(0, 3), torch.tensor([True, True, True]))
    slots.configure(torch.tensor([0]), [(second, 4, 77)])  # slot 0 again: its state starts over
    state = slots.rows(slice(0, 3))
    expected = {
        "temperature": [1.1, before.temperature[1].item(), 0.7], "top_k": [3, before.top_k[1].item(), 9],
        "top_p": [0.9, before.top_p[1].item(), 0.6],
        "repetition_penalty": [1.0, before.repetition_penalty[1].item(), 1.3],
        "ras_threshold": [HISTORY + 1, before.ras_threshold[1].item(), ras_threshold(first)],
        "ras_window": [10, before.ras_window[1].item(), 7], "min_len": [4, 0, 11],
        "ignore_stop": [False, False, True], "seed": [77, 0, 5], "step": [0, 1, 1],
    }
    for name, values in expected.items():
        assert getattr(state, name).tolist() == pytest.approx(values), name
    assert state.history[0].tolist() == [-1] * HISTORY and state.history[2].tolist()[-1] == 5
    assert not state.seen[0].any() and state.seen[2, 5] and state.seen[1, 4]
