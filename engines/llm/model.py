"""CosyVoice2's speech-token LM (`Qwen2LM`, MODEL_FACTS §3.1-3.2) and strict loading of `llm.pt`.

A Qwen2 backbone reads one sequence of embeddings: sos, the prompt text followed by the target text
(Qwen text embeddings), task_id, then the prompt speech tokens (speech embeddings). What the prompt text
and speech tokens are depends on the mode (`layout_prompt`). Each decoded speech token is fed back
through `speech_embedding`; `llm_decoder` maps hidden states to logits over the 6564 speech ids
(codebook + eos + unused stop + fill).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from engines.checkpoints import load_checkpoint, load_strict
from engines.config import LLMConfig
from engines.llm.base import LLMPrompt, PromptMode
from engines.llm.qwen2 import CacheBatch, KVCache, Qwen2ForCausalLM, Qwen2Model

# Where the Qwen2 backbone's tensors sit in `llm.pt` (and in `CosyVoice2LM`'s state dict).
LLM_BACKBONE_PREFIX = "llm.model.model."
# The dtypes the LLM runs, is exported and computes logits in, by the names our options and the Hugging
# Face and TensorRT-LLM configs use.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class Qwen2Encoder(nn.Module):
    """Holds the causal LM as `model`, so the backbone's keys nest as `llm.model.model.*` (as in llm.pt)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.model = Qwen2ForCausalLM(cfg.qwen)


def layout_prompt(mode: PromptMode, voice_text_ids: Sequence[int], voice_speech_tokens: Sequence[int],
                  instruction_ids: Sequence[int] = ()) -> LLMPrompt:
    """The LLM prompt of `mode` for a voice, as the reference front end lays it out (MODEL_FACTS §3.2).

    `voice_text_ids` are the voice's transcript, `voice_speech_tokens` its clip's speech tokens and
    `instruction_ids` the instruction ending in `<|endofprompt|>` (instruct2 only). Zero-shot keeps
    both parts of the voice; cross-lingual drops both (`frontend_cross_lingual`); instruct2 puts the
    instruction where the transcript was and drops the speech tokens (`frontend_instruct2`). The
    voice's speaker embedding, prompt tokens and prompt mel go to token2wav in every mode.
    """
    if mode is not PromptMode.INSTRUCT2 and instruction_ids:
        raise ValueError(f"an instruction needs the instruct2 mode, not {mode}")
    if mode is PromptMode.ZERO_SHOT:
        return LLMPrompt(mode, tuple(voice_text_ids), tuple(voice_speech_tokens))
    if mode is PromptMode.CROSS_LINGUAL:
        return LLMPrompt(mode, (), ())
    return LLMPrompt(mode, tuple(instruction_ids), ())


def prompt_length(num_text_ids: int, num_prompt_speech_tokens: int) -> int:
    """Positions the prompt occupies: sos + all text ids + task_id + prompt speech tokens."""
    return num_text_ids + num_prompt_speech_tokens + 2


class CosyVoice2LM(nn.Module):
    """The state dict matches `llm.pt` exactly (295 tensors at the full config)."""

    def __init__(self, cfg: LLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        hidden = cfg.qwen.hidden_size
        self.llm_embedding = nn.Embedding(2, hidden)
        self.llm = Qwen2Encoder(cfg)
        self.llm_decoder = nn.Linear(hidden, cfg.speech_vocab, bias=True)
        self.speech_embedding = nn.Embedding(cfg.speech_vocab, hidden)

    @property
    def backbone(self) -> Qwen2Model:
        return self.llm.model.model

    def prompt_embeddings_batch(self, text_ids: Tensor, text_lengths: Sequence[int], speech_tokens: Tensor,
                                speech_lengths: Sequence[int]) -> list[Tensor]:
        """`prompt_embeddings` of several prompts whose ids are concatenated (`text_ids` holds each
        prompt's text ids in turn, `text_lengths` long, and likewise the speech tokens): one lookup per
        table for all of them, then one concatenation per prompt."""
        special = self.llm_embedding.weight
        sos, task = special[self.cfg.sos_index].unsqueeze(0), special[self.cfg.task_id_index].unsqueeze(0)
        texts = self.backbone.embed_tokens(text_ids).split(list(text_lengths))
        speech = self.speech_embedding(speech_tokens).split(list(speech_lengths))
        return [torch.cat((sos, text, task, tokens)) for text, tokens in zip(texts, speech, strict=True)]

    def prompt_embeddings(self, text_ids: Tensor, prompt_speech_tokens: Tensor) -> Tensor:
        """Embeddings [P, hidden] of one prompt (§3.2): sos, `text_ids`, task_id, `prompt_speech_tokens`.

        `text_ids` is the prompt text (see `layout_prompt`) followed by the target text (int64, 1-D);
        `prompt_speech_tokens` may be empty. P = `prompt_length(len(text_ids), len(prompt_speech_tokens))`.
        """
        return self.prompt_embeddings_batch(text_ids, [text_ids.numel()], prompt_speech_tokens,
                                            [prompt_speech_tokens.numel()])[0]

    def embed_speech(self, tokens: Tensor) -> Tensor:
        return self.speech_embedding(tokens)

    def forward(self, x: Tensor, batch: CacheBatch, cache: KVCache, layers: int | None = None) -> Tensor:
        """Speech logits [B, speech_vocab] at the last position of each row of input embeddings `x`
        [B, T, hidden]; every position's keys and values go into `cache` (see `Qwen2Model.forward`, also
        for `layers`)."""
        return self.speech_logits(self.backbone(x, batch, cache, layers)[:, -1])

    def speech_logits(self, hidden: Tensor) -> Tensor:
        """Logits over the speech vocabulary (codebook + stop tokens) of hidden states [..., hidden]."""
        return self.llm_decoder(hidden)

    def tie_weights(self) -> None:
        self.llm.model.tie_weights()


def load_llm(path: Path, cfg: LLMConfig, device: torch.device | str, dtype: torch.dtype) -> CosyVoice2LM:
    """Load `llm.pt` strictly into a `CosyVoice2LM` on `device` in `dtype`, in eval mode.

    Raises `engines.checkpoints.CheckpointError` naming the first missing, unexpected or mis-shaped
    tensors when the file does not match `cfg`.
    """
    state = load_checkpoint(path)
    # Build without initialising: every value is overwritten by the checkpoint.
    with torch.device("meta"):
        model = CosyVoice2LM(cfg)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()
    load_strict(model, state, str(path))
    return model.eval().requires_grad_(False)
