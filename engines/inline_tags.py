"""CosyVoice2's inline tags in text to speak: which pass, which are dropped, where text may not be cut.

The tokenizer carries non-verbal tags as single tokens (MODEL_FACTS §2.4): sounds in brackets
(`[laughter]`, `[breath]`, `[cough]`, ...) and two paired spans (`<strong>…</strong>` stresses
words, `<laughter>…</laughter>` speaks them laughing). The rule for text to speak (`clean_tags`):

- a known tag passes untouched (written in any letter case, it becomes the tokenizer's spelling);
- an unknown tag-shaped bracket, `[word]` or `<word>` / `</word>` (a letter, then letters, digits,
  `_` and `-`), is dropped: it is a stage direction (`[music]`, `<em>`) the model has no token for, and
  speaking it aloud would be wrong; the text between an unknown opening and closing tag is kept;
- the prompt markers `<|…|>` (`<|endofprompt|>`, `<|im_start|>`, ...) are dropped: the service
  places `<|endofprompt|>` itself (after an instruction), and a user's text never controls the prompt;
- anything else in brackets (`[1]`, `[see page 3]`, `a < b`) is ordinary text and is spoken.

Cutting text into sentences and segments never cuts inside a tag, nor inside a paired span of at
most `MAX_PROTECTED_SPAN` characters (`protected_spans`); a longer span may be cut like plain text.
"""

from __future__ import annotations

import re

# The tokenizer's tag tokens (`engines.text.SPECIAL_TOKENS`), in its order.
BRACKET_TAGS = ("[breath]", "[noise]", "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]",
                "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]")
PAIRED_TAGS = (("<strong>", "</strong>"), ("<laughter>", "</laughter>"))
ENDOFPROMPT = "<|endofprompt|>"
MAX_PROTECTED_SPAN = 300  # characters; a paired span longer than this may be cut

_KNOWN = {t.lower(): t for t in (*BRACKET_TAGS, *(tag for pair in PAIRED_TAGS for tag in pair))}
_TAG_SHAPED = re.compile(r"\[[A-Za-z][A-Za-z0-9_-]*\]|</?[A-Za-z][A-Za-z0-9_-]*>")
PROMPT_MARKER = re.compile(r"<\|[^<>|]*\|>")
_BRACKET_TAG = re.compile("|".join(re.escape(t) for t in BRACKET_TAGS))
_PAIRED_SPAN = re.compile("|".join(
    rf"{re.escape(opening)}.*?(?:{re.escape(closing)}|$)" for opening, closing in PAIRED_TAGS), re.DOTALL)
_ANY_TAG = re.compile("|".join(re.escape(t) for t in _KNOWN.values()))


def clean_tags(text: str) -> str:
    """`text` with known tags spelled as the tokenizer spells them and unknown tags and prompt markers
    dropped (see the module docstring)."""
    text = PROMPT_MARKER.sub("", text)
    return _TAG_SHAPED.sub(lambda match: _KNOWN.get(match.group().lower(), ""), text)


def strip_tags(text: str) -> str:
    """`text` without its known tags (what is said, for word timings)."""
    return _ANY_TAG.sub(" ", text)


def protected_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every known bracket tag and every paired span of at most `MAX_PROTECTED_SPAN`
    characters in `text`, in order; an opened span not closed yet runs to the end of `text`."""
    spans = [m.span() for m in _BRACKET_TAG.finditer(text)]
    spans += [m.span() for m in _PAIRED_SPAN.finditer(text) if m.end() - m.start() <= MAX_PROTECTED_SPAN]
    return sorted(spans)


def inside(spans: list[tuple[int, int]], position: int) -> bool:
    """Whether a cut at `position` would fall inside one of `spans`."""
    return any(start < position < end for start, end in spans)
