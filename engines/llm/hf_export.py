"""`llm.pt` → a Hugging Face `Qwen2ForCausalLM` directory with the speech vocabulary (MODEL_FACTS §3.5).

This is the checkpoint TensorRT-LLM's Qwen2 converter reads. The text vocabulary is extended with one
token per speech code and five control tokens, appended in this order after the text ids:

    <|s_0|> … <|s_6560|>  <|eos1|> <|eos2|> <|eos3|>  <|sos|> <|task_id|>

The first appended id is `SpeechVocab.text_vocab`: the length of the text tokenizer with CosyVoice2's
special tokens added (151663 for the released tokenizer, `ORIGINAL_VOCAB_SIZE` in the reference runtime;
a synthetic tokenizer gives its own, smaller length). Rows are padded to a multiple of 128.

Weights: `embed_tokens` keeps the text rows below `text_vocab`, then holds `speech_embedding` (6564
rows: codes, eos, unused stop, fill) and `llm_embedding` (sos, task_id); padding rows are zero.
`lm_head` is a new biased projection: weight zero and bias −inf everywhere except the 6564 speech rows,
which hold `llm_decoder`. So only speech codes and the three eos ids can ever be produced.

Neither transformers' `Qwen2ForCausalLM` nor TensorRT-LLM's Qwen model has an `lm_head` bias: both
ignore `lm_head.bias` when loading (the reference conversion saves it all the same). Consumers apply it
themselves: `load_hf_causal_lm` below for transformers, a per-request `embedding_bias` in `trtllm.py`.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engines.checkpoints import load_checkpoint, require_layout, state_shapes
from engines.config import SPEECH_CODEBOOK, SPEECH_VOCAB, LLMConfig, Qwen2Config
from engines.llm.model import LLM_BACKBONE_PREFIX, CosyVoice2LM
from engines.text import load_text_tokenizer

logger = logging.getLogger(__name__)

CONTROL_TOKENS = ("<|eos1|>", "<|eos2|>", "<|eos3|>", "<|sos|>", "<|task_id|>")
VOCAB_PAD_MULTIPLE = 128
WEIGHTS_FILE = "model.safetensors"
VOCAB_FILE = "speech_vocab.json"
LM_HEAD_BIAS = "lm_head.bias"
# The reference chat template: a user turn is `<|sos|>` + text + `<|task_id|>`, an assistant turn is
# the prompt speech tokens verbatim.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '<|sos|>' + message['content'] + '<|task_id|>' }}"
    "{%- elif message['role'] == 'assistant' %}{{- message['content'] }}{%- endif %}"
    "{%- endfor %}"
)
HF_BACKBONE_PREFIX = "model."  # where Hugging Face's Qwen2 keeps the backbone (as CosyVoice-BlankEN does)
HF_EMBED_TOKENS = HF_BACKBONE_PREFIX + "embed_tokens.weight"


def hf_backbone_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The Qwen2 backbone's tensors of an `llm.pt` state dict, under Hugging Face's names."""
    return {HF_BACKBONE_PREFIX + name.removeprefix(LLM_BACKBONE_PREFIX): tensor
            for name, tensor in state.items() if name.startswith(LLM_BACKBONE_PREFIX)}


def speech_token_name(code: int) -> str:
    return f"<|s_{code}|>"


@dataclass(frozen=True)
class SpeechVocab:
    """Id layout of the exported vocabulary; `text_vocab` is the first speech id."""

    text_vocab: int

    def __post_init__(self) -> None:
        if self.text_vocab <= 0:
            raise ValueError(f"text_vocab must be positive, got {self.text_vocab}")

    @property
    def eos_ids(self) -> tuple[int, int, int]:
        """`<|eos1|>`, `<|eos2|>`, `<|eos3|>` ↔ LLM ids 6561 (eos), 6562 (unused stop), 6563 (fill)."""
        first = self.text_vocab + SPEECH_CODEBOOK
        return first, first + 1, first + 2

    @property
    def sos_id(self) -> int:
        return self.text_vocab + SPEECH_VOCAB

    @property
    def task_id(self) -> int:
        return self.sos_id + 1

    @property
    def size(self) -> int:
        return self.task_id + 1

    @property
    def padded_size(self) -> int:
        return math.ceil(self.size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE

    def speech_id(self, code: int) -> int:
        if not 0 <= code < SPEECH_CODEBOOK:
            raise ValueError(f"speech code {code} is outside [0, {SPEECH_CODEBOOK})")
        return self.text_vocab + code

    def to_speech(self, hf_id: int) -> int | None:
        """The speech code of `hf_id`, or None when it is not a speech code (an eos or anything else)."""
        code = hf_id - self.text_vocab
        return code if 0 <= code < SPEECH_CODEBOOK else None

    def prompt_ids(
        self, prompt_text_ids: Sequence[int], text_ids: Sequence[int], prompt_speech_tokens: Sequence[int]
    ) -> list[int]:
        """The zero-shot prompt as ids (§3.2): sos, prompt text, target text, task_id, prompt speech."""
        for tid in (*prompt_text_ids, *text_ids):
            if not 0 <= tid < self.text_vocab:
                raise ValueError(f"text id {tid} is outside the text vocabulary [0, {self.text_vocab})")
        return [
            self.sos_id,
            *prompt_text_ids,
            *text_ids,
            self.task_id,
            *(self.speech_id(code) for code in prompt_speech_tokens),
        ]

    def save(self, hf_dir: Path) -> None:
        (Path(hf_dir) / VOCAB_FILE).write_text(json.dumps({"text_vocab": self.text_vocab}) + "\n")

    @staticmethod
    def load(hf_dir: Path) -> SpeechVocab:
        path = Path(hf_dir) / VOCAB_FILE
        try:
            return SpeechVocab(int(json.loads(path.read_text())["text_vocab"]))
        except (OSError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path} is missing or invalid ({exc}); run `build_engines.py convert-hf`") \
                from exc


def convert_state(
    state: Mapping[str, torch.Tensor], cfg: LLMConfig, vocab: SpeechVocab
) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (float32) from an `llm.pt` state dict; `state` must match `cfg` exactly."""
    _check_llm_state(state, cfg)
    if vocab.text_vocab > cfg.qwen.vocab_size:
        raise ValueError(
            f"the tokenizer has {vocab.text_vocab} ids but the LLM only {cfg.qwen.vocab_size} text rows"
        )
    hidden = cfg.qwen.hidden_size
    offset, speech_end = vocab.text_vocab, vocab.text_vocab + SPEECH_VOCAB
    backbone = hf_backbone_state(state)
    out = {name: tensor.float() for name, tensor in backbone.items() if name != HF_EMBED_TOKENS}
    embed = torch.zeros(vocab.padded_size, hidden)
    embed[:offset] = backbone[HF_EMBED_TOKENS][:offset]
    embed[offset:speech_end] = state["speech_embedding.weight"]
    embed[vocab.sos_id] = state["llm_embedding.weight"][cfg.sos_index]
    embed[vocab.task_id] = state["llm_embedding.weight"][cfg.task_id_index]
    head_weight = torch.zeros(vocab.padded_size, hidden)
    head_bias = torch.full((vocab.padded_size,), float("-inf"))
    head_weight[offset:speech_end] = state["llm_decoder.weight"]
    head_bias[offset:speech_end] = state["llm_decoder.bias"]
    out[HF_EMBED_TOKENS] = embed
    out["lm_head.weight"] = head_weight
    out[LM_HEAD_BIAS] = head_bias
    return out


def _check_llm_state(state: Mapping[str, torch.Tensor], cfg: LLMConfig) -> None:
    with torch.device("meta"):
        expected = state_shapes(CosyVoice2LM(cfg).state_dict())
    require_layout(expected, state_shapes(state), "llm.pt does not match the LLM configuration")


def qwen2_hf_config(qwen: Qwen2Config) -> dict[str, object]:
    """The architecture part of a Hugging Face Qwen2 `config.json`, with transformers 4.x key names
    (`rope_theta`).

    TensorRT-LLM's converter reads them through the transformers of its own image; transformers 5 reads
    them too (it maps `rope_theta` to `rope_parameters`).
    """
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": qwen.hidden_size,
        "intermediate_size": qwen.intermediate_size,
        "num_hidden_layers": qwen.num_layers,
        "num_attention_heads": qwen.num_heads,
        "num_key_value_heads": qwen.num_kv_heads,
        "max_position_embeddings": qwen.max_position_embeddings,
        "rms_norm_eps": qwen.rms_norm_eps,
        "rope_theta": qwen.rope_theta,
        "use_sliding_window": False,
    }


def hf_config(cfg: LLMConfig, vocab: SpeechVocab, dtype: torch.dtype) -> dict[str, object]:
    """The export's `config.json`: the architecture with the speech vocabulary and an untied head
    (`torch_dtype` is also the transformers 4.x name)."""
    return {
        **qwen2_hf_config(cfg.qwen),
        "max_window_layers": cfg.qwen.num_layers,
        "attention_dropout": 0.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "vocab_size": vocab.padded_size,
        "bos_token_id": vocab.sos_id,
        "eos_token_id": vocab.eos_ids[0],
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }


def generation_config(vocab: SpeechVocab) -> dict[str, object]:
    """The reference's generation defaults: stop on any eos id; top-p 0.8, top-k 25, temperature 1."""
    return {
        "eos_token_id": list(vocab.eos_ids),
        "pad_token_id": vocab.eos_ids[0],
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 0.8,
        "top_k": 25,
    }


def export_tokenizer(tokenizer_dir: Path, out_dir: Path) -> SpeechVocab:
    """Save the text tokenizer extended with the speech and control tokens; returns the id layout."""
    tokenizer = load_text_tokenizer(tokenizer_dir)
    vocab = SpeechVocab(len(tokenizer))
    tokenizer.add_tokens([speech_token_name(code) for code in range(SPEECH_CODEBOOK)] + list(CONTROL_TOKENS))
    # The added tokens must land exactly on the layout the weights are written for.
    for token, expected in ((speech_token_name(0), vocab.text_vocab), (CONTROL_TOKENS[-1], vocab.task_id)):
        actual = tokenizer.convert_tokens_to_ids(token)
        if actual != expected:
            raise ValueError(f"{tokenizer_dir}: {token} got id {actual}, expected {expected}")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(str(out_dir))
    return vocab


def export_hf(
    llm_path: Path, tokenizer_dir: Path, out_dir: Path, cfg: LLMConfig, dtype: torch.dtype = torch.bfloat16
) -> SpeechVocab:
    """Write the Hugging Face directory for `llm_path` into `out_dir` (created; files overwritten).

    The weights file is written last, so a directory with `model.safetensors` is complete.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab = export_tokenizer(tokenizer_dir, out_dir)
    tensors = convert_state(load_checkpoint(llm_path), cfg, vocab)
    (out_dir / "config.json").write_text(json.dumps(hf_config(cfg, vocab, dtype), indent=2) + "\n")
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config(vocab), indent=2) + "\n")
    vocab.save(out_dir)
    tmp = out_dir / (WEIGHTS_FILE + ".tmp")
    save_file({k: v.to(dtype).contiguous() for k, v in tensors.items()}, str(tmp), metadata={"format": "pt"})
    tmp.replace(out_dir / WEIGHTS_FILE)
    logger.info(
        "exported %s to %s (%d ids, %d rows, %s)", llm_path, out_dir, vocab.size, vocab.padded_size, dtype
    )
    return vocab


def is_exported(out_dir: Path) -> bool:
    """Whether `out_dir` holds a complete export (weights with the head bias, config, vocabulary)."""
    out_dir = Path(out_dir)
    try:
        SpeechVocab.load(out_dir)
        json.loads((out_dir / "config.json").read_text())
        with safe_open(str(out_dir / WEIGHTS_FILE), framework="pt") as f:
            return LM_HEAD_BIAS in f.keys()  # noqa: SIM118 (safe_open handles are not containers)
    except (OSError, ValueError, json.JSONDecodeError):
        return False


def read_lm_head_bias(hf_dir: Path) -> torch.Tensor:
    """`lm_head.bias` (padded vocabulary) as float32, read without loading the other weights."""
    with safe_open(str(Path(hf_dir) / WEIGHTS_FILE), framework="pt") as f:
        return f.get_tensor(LM_HEAD_BIAS).float()


def load_hf_causal_lm(hf_dir: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' `Qwen2ForCausalLM` for an export, with the biased head it lacks, loaded strictly."""
    from safetensors.torch import load_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config.from_pretrained(str(hf_dir))
    model = Qwen2ForCausalLM(config)
    model.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True)
    model.load_state_dict(load_file(str(Path(hf_dir) / WEIGHTS_FILE)), strict=True)
    return model.to(dtype).eval()  # type: ignore[arg-type]  # transformers types `to` too narrowly
