"""The Hugging Face export computes the same speech logits as our CosyVoice2 LM (tiny random model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from engines.build.tokenizer import write_qwen2_tokenizer
from engines.checkpoints import CheckpointError
from engines.config import SPEECH_CODEBOOK, SPEECH_VOCAB, LLMConfig, ModelConfigs
from engines.llm.hf_export import (
    VOCAB_PAD_MULTIPLE,
    SpeechVocab,
    export_hf,
    is_exported,
    load_hf_causal_lm,
)
from engines.llm.model import CosyVoice2LM
from engines.llm.qwen2 import CacheBatch, KVCache

CFG: LLMConfig = ModelConfigs.tiny().llm
DECODE_STEPS = 4


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, CosyVoice2LM]:
    root = tmp_path_factory.mktemp("llm")
    write_qwen2_tokenizer(root / "tokenizer")
    torch.manual_seed(0)
    model = CosyVoice2LM(CFG)
    # Non-zero biases, so a head that dropped them would fail the comparison.
    with torch.no_grad():
        model.llm_decoder.bias.normal_()
    torch.save(model.state_dict(), root / "llm.pt")
    return root / "llm.pt", root / "tokenizer", model.eval()


def test_vocab_layout_reduces_to_the_released_ids() -> None:
    vocab = SpeechVocab(151663)
    assert vocab.speech_id(0) == 151663 and vocab.speech_id(6560) == 158223
    assert vocab.eos_ids == (158224, 158225, 158226)
    assert (vocab.sos_id, vocab.task_id, vocab.size, vocab.padded_size) == (158227, 158228, 158229, 158336)
    assert vocab.to_speech(158223) == 6560 and vocab.to_speech(158224) is None and vocab.to_speech(5) is None
    assert vocab.prompt_ids([7], [8, 9], [0, 6560]) == [158227, 7, 8, 9, 158228, 151663, 158223]
    with pytest.raises(ValueError, match="text vocabulary"):
        vocab.prompt_ids([], [151663], [])


def _our_logits(
    model: CosyVoice2LM, text_ids: list[int], prompt_speech: list[int], steps: list[int]
) -> list[torch.Tensor]:
    """Speech logits after the prompt and after feeding each of `steps`, with a KV cache."""
    cache = KVCache.allocate(CFG.qwen, slots=1, max_len=256, device=torch.device("cpu"), dtype=torch.float32)
    x = model.prompt_embeddings(torch.tensor(text_ids), torch.tensor(prompt_speech, dtype=torch.long))
    length = x.shape[0]
    out = [model(x[None], CacheBatch(0, torch.arange(length)[None], length), cache)[0]]
    for token in steps:
        x = model.embed_speech(torch.tensor([[token]]))
        out.append(model(x, CacheBatch(0, torch.tensor([[length]]), length + 1), cache)[0])
        length += 1
    return out


def _hf_logits(
    hf: torch.nn.Module, vocab: SpeechVocab, prompt: list[int], steps: list[int]
) -> list[torch.Tensor]:
    ids = list(prompt)
    out = []
    for token in [None, *steps]:
        if token is not None:
            ids.append(vocab.speech_id(token))
        out.append(hf(input_ids=torch.tensor([ids])).logits[0, -1])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_export_matches_our_model(
    source: tuple[Path, Path, CosyVoice2LM], tmp_path: Path, dtype: torch.dtype
) -> None:
    llm_path, tokenizer_dir, model = source
    vocab = export_hf(llm_path, tokenizer_dir, tmp_path / "hf", CFG, dtype=dtype)
    assert is_exported(tmp_path / "hf")
    assert vocab == SpeechVocab.load(tmp_path / "hf")

    generator = torch.Generator().manual_seed(1)
    prompt_text = torch.randint(0, vocab.text_vocab, (5,), generator=generator).tolist()
    text = torch.randint(0, vocab.text_vocab, (7,), generator=generator).tolist()
    prompt_speech = torch.randint(0, SPEECH_CODEBOOK, (6,), generator=generator).tolist()
    steps = torch.randint(0, SPEECH_CODEBOOK, (DECODE_STEPS,), generator=generator).tolist()

    ours = _our_logits(model, prompt_text + text, prompt_speech, steps)
    hf = load_hf_causal_lm(tmp_path / "hf", torch.float32)
    theirs = _hf_logits(hf, vocab, vocab.prompt_ids(prompt_text, text, prompt_speech), steps)

    speech = slice(vocab.text_vocab, vocab.text_vocab + SPEECH_VOCAB)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    for mine, full in zip(ours, theirs, strict=True):
        assert full.shape == (vocab.padded_size,)
        torch.testing.assert_close(full[speech], mine, atol=tolerance, rtol=tolerance)
        # Nothing outside the speech rows (text, sos/task_id, padding) can ever be produced.
        outside = torch.cat((full[: speech.start], full[speech.stop :]))
        assert torch.isneginf(outside).all()


def test_export_files_follow_the_published_layout(
    source: tuple[Path, Path, CosyVoice2LM], tmp_path: Path
) -> None:
    llm_path, tokenizer_dir, _ = source
    vocab = export_hf(llm_path, tokenizer_dir, tmp_path, CFG)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vocab_size"] == vocab.padded_size and vocab.padded_size % VOCAB_PAD_MULTIPLE == 0
    assert config["tie_word_embeddings"] is False and config["torch_dtype"] == "bfloat16"
    assert config["rope_theta"] == CFG.qwen.rope_theta and config["eos_token_id"] == vocab.eos_ids[0]
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == list(vocab.eos_ids)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_tensor("lm_head.bias").dtype == torch.bfloat16
    assert {"model.embed_tokens.weight", "lm_head.weight", "lm_head.bias"} <= names
    assert not any(name.startswith("llm") for name in names)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tokenizer) == vocab.size
    ids = tokenizer.encode("<|sos|><|task_id|><|s_0|><|s_6560|><|eos3|>", add_special_tokens=False)
    assert ids == [vocab.sos_id, vocab.task_id, vocab.speech_id(0), vocab.speech_id(6560), vocab.eos_ids[2]]
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<|s_3|>"}], tokenize=False
    )
    assert chat == "<|sos|>hi<|task_id|><|s_3|>"


def test_export_rejects_a_checkpoint_of_another_size(
    source: tuple[Path, Path, CosyVoice2LM], tmp_path: Path
) -> None:
    llm_path, tokenizer_dir, _ = source
    with pytest.raises(CheckpointError, match="wrong shape"):
        export_hf(llm_path, tokenizer_dir, tmp_path, ModelConfigs.full().llm)
    assert not is_exported(tmp_path)
