"""Which prompt mode a request is spoken in, and the LLM prompts of (voice, mode, instruction) kept for
reuse, so that a repeated instruction costs a dictionary lookup."""

from __future__ import annotations

from collections import OrderedDict

from engines.llm.base import LLMPrompt, PromptMode
from engines.llm.model import layout_prompt
from engines.text import TextError, TextFrontend
from realtime.session import PreparedVoice, ServiceError, SpeechRequest

PROMPT_CACHE_SIZE = 1024  # prompts kept (LRU); an instruct2 prompt is at most a few hundred ints


def choose_mode(request: SpeechRequest, voice_language: str) -> PromptMode:
    """The mode `request` is spoken in with a voice of `voice_language`, or ServiceError.

    Instructions ask for instruct2; otherwise an explicit `mode` wins; otherwise a `language` other
    than the voice's means cross-lingual (none of the clip's words may leak into the speech); otherwise
    zero-shot.
    """
    if request.instructions is not None:
        if request.mode not in (None, PromptMode.INSTRUCT2):
            raise ServiceError("invalid_mode", f"instructions need the instruct2 mode, not {request.mode}")
        return PromptMode.INSTRUCT2
    if request.mode is PromptMode.INSTRUCT2:
        raise ServiceError("missing_instructions", "the instruct2 mode needs instructions")
    if request.mode is not None:
        return request.mode
    if request.language is not None and request.language != voice_language:
        return PromptMode.CROSS_LINGUAL
    return PromptMode.ZERO_SHOT


class PromptCache:
    """LLM prompts by (voice, mode, instructions), least recently used dropped past `capacity`.

    A voice's entries must be dropped (`forget`) when the voice is removed or replaced.
    """

    def __init__(self, text: TextFrontend, capacity: int = PROMPT_CACHE_SIZE) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self._text = text
        self._capacity = capacity
        self._prompts: OrderedDict[tuple[str, PromptMode, str], LLMPrompt] = OrderedDict()

    def __len__(self) -> int:
        return len(self._prompts)

    def get(self, voice: PreparedVoice, mode: PromptMode, instructions: str | None) -> LLMPrompt:
        """The prompt of `voice` in `mode` (with `instructions` in instruct2); ServiceError
        (`instructions_too_long`, `empty_instructions`) for instructions the front end refuses."""
        key = (voice.voice_id, mode, instructions or "")
        prompt = self._prompts.get(key)
        if prompt is not None:
            self._prompts.move_to_end(key)
            return prompt
        instruction_ids: list[int] = []
        if mode is PromptMode.INSTRUCT2:
            if instructions is None:
                raise ServiceError("missing_instructions", "the instruct2 mode needs instructions")
            try:
                instruction_ids = self._text.encode_instruction(instructions)
            except TextError as exc:
                raise ServiceError(exc.code, str(exc)) from exc
        prompt = layout_prompt(mode, voice.prompt_text_ids, voice.prompt_speech_tokens, instruction_ids)
        self._prompts[key] = prompt
        if len(self._prompts) > self._capacity:
            self._prompts.popitem(last=False)
        return prompt

    def forget(self, voice_id: str) -> None:
        """Drop every prompt of `voice_id`."""
        for key in [key for key in self._prompts if key[0] == voice_id]:
            del self._prompts[key]
