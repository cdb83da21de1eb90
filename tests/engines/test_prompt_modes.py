"""CosyVoice2's prompt modes (zero_shot, cross_lingual, instruct2) in both LLM engines.

The expected sequences are built here from MODEL_FACTS §3.2 and the reference front end
(`frontend_zero_shot`, `frontend_cross_lingual`, `frontend_instruct2`), straight from the weights:
sos, the prompt text (the voice's transcript / nothing / the instruction) and the target text, task_id,
then the voice's prompt speech tokens in zero_shot only. What the PyTorch engine prefilled is recorded
on the real engine; the TensorRT-LLM engine's prompt ids must select the same rows of the exported
embedding table.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import pytest
import torch
from test_llm_engine import TINY, collect, tiny_loader

from engines.config import SPEECH_CODEBOOK
from engines.llm.base import ALL_MODES, LLMError, LLMPrompt, LLMRequest, PromptMode, SamplingParams
from engines.llm.hf_export import SpeechVocab, convert_state
from engines.llm.model import CosyVoice2LM, layout_prompt
from engines.llm.torch_engine import TorchLLMConfig, TorchLLMEngine
from engines.llm.trtllm import EngineLimits, plan_request

CONFIG = TorchLLMConfig(device="cpu", max_slots=4, max_context=400, max_waiting=16, prefill_chunk=24,
                        min_kv_bucket=32)
VOCAB = SpeechVocab(TINY.qwen.vocab_size - 3)  # the export's text rows: all but a few of the model's
LIMITS = EngineLimits(max_batch_size=4, max_input_len=400, max_seq_len=800, vocab_size=VOCAB.padded_size,
                      logits_dtype=torch.float32)

TRANSCRIPT = [11, 12, 13, 14, 15, 16]  # the voice's transcript ids
VOICE_TOKENS = [(97 * i + 5) % SPEECH_CODEBOOK for i in range(23)]
ENDOFPROMPT = 40  # stands for `<|endofprompt|>` (the engine treats it as any text id)
INSTRUCTION = [31, 32, 33, 34, ENDOFPROMPT]
TARGET = [101, 102, 103, 104]


def expected_embeddings(model: CosyVoice2LM, mode: PromptMode) -> torch.Tensor:
    """§3.2 from the weights: [sos, prompt text + target text, task_id, prompt speech]."""
    sos, task = model.llm_embedding.weight[0], model.llm_embedding.weight[1]
    text_rows = model.llm.model.model.embed_tokens.weight
    speech_rows = model.speech_embedding.weight
    prompt_text = {PromptMode.ZERO_SHOT: TRANSCRIPT, PromptMode.CROSS_LINGUAL: [],
                   PromptMode.INSTRUCT2: INSTRUCTION}[mode]
    prompt_speech = VOICE_TOKENS if mode is PromptMode.ZERO_SHOT else []
    text = [text_rows[i] for i in prompt_text + TARGET]
    return torch.stack([sos, *text, task, *(speech_rows[t] for t in prompt_speech)])


def mode_request(mode: PromptMode, request_id: str = "r", text: Sequence[int] = TARGET,
                 **sampling: object) -> LLMRequest:
    instruction = INSTRUCTION if mode is PromptMode.INSTRUCT2 else ()
    prompt = layout_prompt(mode, TRANSCRIPT, VOICE_TOKENS, instruction)
    return prompt.request(request_id, list(text), SamplingParams(**sampling))  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def recording_engine(config: TorchLLMConfig = CONFIG, eos_bias: float = 0.0
                           ) -> AsyncIterator[tuple[TorchLLMEngine, list[torch.Tensor]]]:
    """The real engine, with the prompt embeddings its runner hands to the prefill recorded."""
    engine = TorchLLMEngine(config, tiny_loader(eos_bias))
    await engine.start()
    runner = engine._runner
    assert runner is not None
    prefilled: list[torch.Tensor] = []
    begin = runner.begin

    def recording_begin(seqs):  # type: ignore[no-untyped-def]
        embeddings = begin(seqs)
        prefilled.extend(e.clone() for e in embeddings)
        return embeddings

    runner.begin = recording_begin  # type: ignore[method-assign]
    try:
        yield engine, prefilled
    finally:
        await engine.stop()


@pytest.mark.parametrize("mode", list(PromptMode))
async def test_the_torch_engine_prefills_each_modes_reference_sequence(mode: PromptMode) -> None:
    async with recording_engine() as (engine, prefilled):
        await collect(engine.submit(mode_request(mode, fixed_length=3, seed=1)))
        assert len(prefilled) == 1
        expected = expected_embeddings(engine._runner.model, mode)  # type: ignore[union-attr]
        torch.testing.assert_close(prefilled[0], expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", list(PromptMode))
@torch.no_grad()
def test_the_tensorrt_llm_prompt_ids_select_the_same_embeddings(mode: PromptMode) -> None:
    torch.manual_seed(0)
    model = CosyVoice2LM(TINY).eval()
    exported_rows = convert_state(model.state_dict(), TINY, VOCAB)["model.embed_tokens.weight"]
    plan = plan_request(mode_request(mode), VOCAB, LIMITS, seed=0)
    expected = expected_embeddings(model, mode)
    assert torch.count_nonzero(expected).item() == expected.numel()  # nothing a zero row could fake
    torch.testing.assert_close(exported_rows[plan.input_ids], expected, rtol=0, atol=0)
    request = mode_request(mode)
    ours = model.prompt_embeddings(torch.tensor([*request.prompt_text_ids, *request.text_ids]),
                                   torch.tensor(list(request.prompt_speech_tokens), dtype=torch.int64))
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)


@pytest.mark.parametrize("mode", list(PromptMode))
def test_length_bounds_count_the_target_text_only(mode: PromptMode) -> None:
    # min_token_text_ratio 2 and max 20 times the target's tokens, whatever the prompt text holds.
    plan = plan_request(mode_request(mode), VOCAB, LIMITS, seed=0)
    assert plan.sampling["min_tokens"] == 2 * len(TARGET)
    assert plan.max_tokens == 20 * len(TARGET)


async def test_the_torch_engine_stops_within_the_target_texts_bounds_in_instruct2() -> None:
    target = [101, 102]
    # eos strongly favoured: eos is banned below 2 x 2 tokens, then taken at once.
    async with recording_engine(eos_bias=40.0) as (engine, _):
        short = await collect(engine.submit(mode_request(PromptMode.INSTRUCT2, "a", target, seed=3)))
    assert len(short) == 2 * len(target)
    # eos never taken: the request runs to 20 x 2 tokens, not 20 x (instruction + target).
    async with recording_engine(eos_bias=-1e4) as (engine, _):
        long = await collect(engine.submit(mode_request(PromptMode.INSTRUCT2, "b", target, seed=3,
                                                        use_ras=False, top_k=1)))
    assert len(long) == 20 * len(target)


def test_a_prompt_must_fit_its_mode() -> None:
    with pytest.raises(ValueError, match="cross_lingual"):
        LLMRequest("r", [1], prompt_text_ids=[2], mode=PromptMode.CROSS_LINGUAL)
    with pytest.raises(ValueError, match="instruct2"):
        LLMRequest("r", [1], prompt_text_ids=[2], prompt_speech_tokens=[3], mode=PromptMode.INSTRUCT2)
    with pytest.raises(ValueError, match="instruct2"):
        LLMPrompt(PromptMode.INSTRUCT2, (), ())
    with pytest.raises(ValueError, match="instruct2 mode"):
        layout_prompt(PromptMode.ZERO_SHOT, TRANSCRIPT, VOICE_TOKENS, INSTRUCTION)


async def test_an_engine_refuses_a_mode_it_does_not_serve() -> None:
    config = TorchLLMConfig(device="cpu", max_slots=2, max_context=160, prefill_chunk=24, min_kv_bucket=32,
                            modes=frozenset({PromptMode.ZERO_SHOT}))
    async with recording_engine(config) as (engine, prefilled):
        assert engine.modes == {PromptMode.ZERO_SHOT} and set(PromptMode) == ALL_MODES
        for mode in (PromptMode.CROSS_LINGUAL, PromptMode.INSTRUCT2):
            with pytest.raises(LLMError) as refused:
                engine.submit(mode_request(mode))
            assert refused.value.code == "mode_not_supported" and "zero_shot" in str(refused.value)
        assert len(await collect(engine.submit(mode_request(PromptMode.ZERO_SHOT, fixed_length=2)))) == 2
        assert len(prefilled) == 1


async def test_an_instruction_that_leaves_no_room_is_refused() -> None:
    config = TorchLLMConfig(device="cpu", max_slots=2, max_context=64, prefill_chunk=24, min_kv_bucket=32)
    long_instruction = LLMPrompt(PromptMode.INSTRUCT2, tuple(range(200, 260)), ())
    async with recording_engine(config) as (engine, _):
        with pytest.raises(LLMError) as refused:
            engine.submit(long_instruction.request("r", TARGET, SamplingParams()))
        assert refused.value.code == "context_too_long"
    with pytest.raises(LLMError) as refused_trt:
        plan_request(LLMPrompt(PromptMode.INSTRUCT2, tuple(range(200, 600)), ()).request(
            "r", TARGET, SamplingParams()), VOCAB, LIMITS, seed=0)
    assert refused_trt.value.code == "context_too_long"
