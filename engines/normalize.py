"""Text normalisation as CosyVoice's front end does it without `ttsfrd` (its `wetext` path).

`ReferenceNormalizer` is a `engines.text.Normalizer`: str → str, applied to each text (or streamed
sentence) before it is cut into segments and tokenised, and to a voice's transcript. The steps, in
the reference's order:

1. Text holding `<|` and `|>` (the model's own markup) is left as it is, as the reference skips its
   front end then.
2. Language: Chinese when any character lies in U+4E00–U+9FFF, else English (`contains_chinese`).
3. `wetext` text normalisation (numbers, money, dates, times, ordinals, measures, URLs, phone numbers) in
   that language, for text that holds a digit (wetext 0.0.4's rule, the version the reference pins).
4. Chinese: newlines dropped, blanks kept only between two ASCII characters, ² → 平方 and ³ → 立方,
   "." → "。", " - " → "，", the brackets （）【】, backticks and "——" removed, trailing commas → "。".
   English: digit runs still left spelled out by `inflect` ("12" → "twelve").

Departures, each for a reason (docs/fidelity.md): wetext runs on windows of whole sentences of about
160 characters at most, a longer sentence cut at clauses or words (its cost grows faster than the text;
the reference normalises the whole text at once), the inline tags of CosyVoice2's
tokenizer (`[laughter]`, `<strong>`, …) are never handed to wetext, so they reach the tokenizer intact,
and only ASCII digits are spelled out.

wetext holds the GIL while it transduces (≈ 10–40 ms for a sentence with digits, 1–3 s for a 4 KB
text full of numbers, on the loaded 2-core dev machine), one window at a time: call it off the event
loop. Text without digits costs microseconds.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from engines.text import SPECIAL_TOKENS, collapse_whitespace

if TYPE_CHECKING:
    import inflect
    from wetext import Normalizer as WetextNormalizer

logger = logging.getLogger(__name__)

Language = Literal["zh", "en"]

_CHINESE = re.compile(r"[\u4e00-\u9fff]")
_DIGIT = re.compile(r"\d")
_ASCII_DIGITS = re.compile(r"[0-9]+")
_TAG = re.compile("(" + "|".join(re.escape(token) for token in SPECIAL_TOKENS) + ")")
# Sentence gaps (kept when the pieces are joined again): whitespace after an ASCII terminal, the point
# right after a CJK terminal, and newlines.
_SENTENCE_GAP = re.compile(r"((?<=[.!?;])[ \t]+|(?<=[。！？；])|\n+)")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_SOFT_BREAK = re.compile(r"[,，、:：]\s*|\s+")
# wetext's cost grows faster than the text (≈ 15 ms for 80 characters, 400 ms for 650, 2.2 s for 900
# without a sentence end, here): it gets windows of whole sentences up to about this long, which keep
# an abbreviation's full stop ("Jan. 5, 2024") inside the context its reading depends on.
WINDOW_CHARS = 160
_IMPORTING_INFLECT = threading.Lock()


def detect_language(text: str) -> Language:
    """The reference's rule: Chinese as soon as one CJK unified ideograph occurs, English otherwise."""
    return "zh" if _CHINESE.search(text) else "en"


class ReferenceNormalizer:
    """CosyVoice's `text_normalize` (wetext path, no paragraph split); keeps no state between calls.

    wetext loads all its transducers when first imported (1.5 s on an idle core, several times that
    on a busy one): build one per process, at start-up, off the event loop.
    """

    def __init__(self) -> None:
        from wetext import Normalizer as WetextNormalizer

        spelling = import_inflect()

        self._wetext: dict[Language, WetextNormalizer] = {
            "zh": WetextNormalizer(lang="zh", operator="tn", remove_erhua=False),
            "en": WetextNormalizer(lang="en", operator="tn"),
        }
        self._inflect: inflect.engine = spelling.engine()

    def __call__(self, text: str) -> str:
        text = collapse_whitespace(text)
        if "<|" in text and "|>" in text:
            return text
        language = detect_language(text)
        text = "".join(self._wetext_window(window, language) for window in _windows(text))
        return _chinese_cleanups(text) if language == "zh" else self._spell_out_numbers(text)

    def normalises_quickly(self, text: str) -> bool:
        """Whether normalising `text` stays out of wetext and inflect (microseconds): it has no digit."""
        return not _DIGIT.search(text)

    def _wetext_window(self, window: str, language: Language) -> str:
        """wetext over the runs of `window` between inline tags; whitespace around each run is kept."""
        if not _DIGIT.search(window):
            return window
        runs = _TAG.split(window)
        return "".join(run if i % 2 else self._wetext_run(run, language) for i, run in enumerate(runs))

    def _wetext_run(self, run: str, language: Language) -> str:
        core = run.strip()
        if not _DIGIT.search(core):
            return run
        try:
            spoken = str(self._wetext[language].normalize(core))
        except Exception:  # kaldifst raises plain RuntimeErrors; the raw text is still speakable.
            logger.warning("wetext could not normalise a %d-character %s run; kept as written", len(core),
                           language)
            return run
        lead, trail = run[: len(run) - len(run.lstrip())], run[len(run.rstrip()) :]
        return f"{lead}{spoken}{trail}"

    def _spell_out_numbers(self, text: str) -> str:
        return _ASCII_DIGITS.sub(lambda match: self._number_words(match.group()), text)

    def _number_words(self, digits: str) -> str:
        import inflect

        try:
            return str(self._inflect.number_to_words(digits))
        except inflect.NumOutOfRangeError:  # beyond inflect's named powers: read it digit by digit
            return str(self._inflect.number_to_words(digits, group=1))


def import_inflect() -> ModuleType:
    """inflect, imported without typeguard's instrumentation: its `@typechecked` re-parses inflect's source
    at import to insert argument checks (1.6 s of CPU on the dev machine, ~2.3 s on an H100 host, while
    the other engines load under the same GIL). The words are the same; only an argument of a wrong type
    would fail otherwise, and this module passes digit strings alone."""
    with _IMPORTING_INFLECT:  # one import at a time, so the original decorator is the one put back
        loaded = sys.modules.get("inflect")
        if loaded is not None:
            return loaded
        import typeguard

        instrumenting = typeguard.typechecked
        typeguard.typechecked = _unchecked  # type: ignore[assignment]
        try:
            import inflect
        finally:
            typeguard.typechecked = instrumenting
        return inflect


def _unchecked(target: Any = None, **options: Any) -> Any:
    """`typeguard.typechecked` that leaves what it decorates as it is (bare or with options)."""
    return target if target is not None else _unchecked


def _windows(text: str) -> list[str]:
    """`text` in consecutive pieces that concatenate back to it: whole sentences packed up to about
    `WINDOW_CHARS`, never across a newline; a longer sentence is cut at clause or word boundaries (at
    `WINDOW_CHARS`, outside any inline tag, when it has none), so no piece costs wetext more than a
    window's worth."""
    pieces = _SENTENCE_GAP.split(text)  # sentence, gap, sentence, gap, …, sentence
    windows: list[str] = []
    current = ""
    for index, piece in enumerate(pieces):
        if index % 2 and "\n" in piece:
            windows += [current, piece]
            current = ""
            continue
        for part in [piece] if index % 2 else _bounded(piece):
            if current.strip() and len(current) + len(part) > WINDOW_CHARS:
                windows.append(current)
                current = ""
            current += part
    return [*windows, current]


def _bounded(sentence: str) -> list[str]:
    """`sentence` cut into parts of at most `WINDOW_CHARS` characters."""
    parts = []
    while len(sentence) > WINDOW_CHARS:
        breaks = [m.end() for m in _SOFT_BREAK.finditer(sentence, 0, WINDOW_CHARS)]
        cut = breaks[-1] if breaks else _outside_tags(sentence, WINDOW_CHARS)
        parts.append(sentence[:cut])
        sentence = sentence[cut:]
    return [*parts, sentence]


def _outside_tags(text: str, cut: int) -> int:
    """`cut`, moved off any inline tag it would split (to the tag's start, or its end at the start)."""
    for match in _TAG.finditer(text):
        if match.start() < cut < match.end():
            return match.start() or match.end()
    return cut


def _chinese_cleanups(text: str) -> str:
    text = text.replace("\n", "")
    text = _drop_blanks_between_non_ascii(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for bracket in ("（", "）", "【", "】", "`"):
        text = text.replace(bracket, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def _drop_blanks_between_non_ascii(text: str) -> str:
    """A space stays only between two ASCII non-space characters (English words inside Chinese)."""
    kept = []
    for i, char in enumerate(text):
        if char == " ":
            before, after = text[i - 1 : i], text[i + 1 : i + 2]
            if not (_ascii_word_char(before) and _ascii_word_char(after)):
                continue
        kept.append(char)
    return "".join(kept)


def _ascii_word_char(char: str) -> bool:
    return char.isascii() and char not in ("", " ")
