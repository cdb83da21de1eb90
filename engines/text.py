"""Text front end: the CosyVoice2 Qwen2 tokenizer, a normalisation hook and sentence segmentation.

The tokenizer is the one shipped in `CosyVoice-BlankEN/` (vocab.json, merges.txt, tokenizer_config.json)
with CosyVoice2's extra special tokens added in a fixed order (MODEL_FACTS §2.4), so their ids follow
the base vocabulary exactly as in the reference. Encoding adds no BOS/EOS.

Long text is cut into synthesis segments of at most ~`max_tokens` tokens at sentence boundaries (then
clause, word and character boundaries for a sentence that is too long by itself); each segment is one
LLM request. `StreamingSentenceSplitter` does the same for text that arrives piece by piece. Neither
cuts inside an inline tag or a short paired span (`engines.inline_tags`); `prepare` applies the tag rule.
An instruction (instruct2) is encoded by `encode_instruction`: without normalisation, as the reference
takes it, ending in `<|endofprompt|>`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import re
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from engines.errors import CodedError
from engines.files import write_whole
from engines.inline_tags import ENDOFPROMPT, PROMPT_MARKER, clean_tags, inside, protected_spans

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Added after the base vocabulary in this order; `<|im_start|>`/`<|im_end|>` already exist and keep their ids.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>", "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]", "[quick_breath]", "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]", "[lipsmack]", "[mn]",
)
EOS_TOKEN = "<|endoftext|>"

DEFAULT_MAX_TEXT_CHARS = 8000
# Bump when `load_text_tokenizer` builds the tokenizer differently: kept tokenizers of older builds are then
# not read (engines/text.load_backend_tokenizer).
TOKENIZER_BUILD = "qwen2-fast-eos-pad-specials/1"
DEFAULT_MAX_INSTRUCTION_TOKENS = 256  # `<|endofprompt|>` included
# `prepares_quickly`: at most ~0.4 ms of the 2-core dev machine's CPU for text within these bounds.
QUICK_TEXT_CHARS = 200
QUICK_TEXT_SENTENCES = 8  # cutting joins sentences one tokenizer call at a time

# A sentence ends after terminal punctuation (plus closing quotes/brackets). ASCII terminals need
# following whitespace (so "3.14" or "e.g.x" do not split); CJK terminals and newlines do not.
_CLOSERS = "\"')]}”’」』）》"
_SENTENCE_END = re.compile(
    rf"[.!?;]+[{re.escape(_CLOSERS)}]*(?=\s)|[。！？；]+[{re.escape(_CLOSERS)}]*|\n+"
)
_CLAUSE_END = re.compile(r"[,:，、：]+(?=\s)|[，、：]+")
_WORD_END = re.compile(r"\s+")
# Terminal punctuation at the very end of a buffer, and the start of a new sentence right after it.
_TRAILING_TERMINAL = re.compile(rf"[.!?;]+[{re.escape(_CLOSERS)}]*$")
_SENTENCE_START = re.compile(r"[\"'“‘(\[]?[A-Z\u00C0-\u00DE\u0391-\u03A9\u0410-\u042F]")
_ANY_CHAR = re.compile(".", re.DOTALL)


class TextError(CodedError, ValueError):
    """Text that cannot be synthesised; `code` is machine readable (`empty_text`, `text_too_long`,
    `empty_instructions`, `instructions_too_long`)."""


Normalizer = Callable[[str], str]


def collapse_whitespace(text: str) -> str:
    """The default normalisation: runs of spaces/tabs become one space, blank lines collapse, ends trimmed."""
    lines = (" ".join(line.split()) for line in text.splitlines())
    return "\n".join(line for line in lines if line)


def _cut_after(text: str, pattern: re.Pattern[str]) -> list[str]:
    """`text` cut right after every match of `pattern` that is not inside an inline tag or paired span
    (the pieces concatenate back to `text`)."""
    spans = protected_spans(text)
    pieces, start = [], 0
    for match in pattern.finditer(text):
        if match.end() > start and not inside(spans, match.end()):
            pieces.append(text[start:match.end()])
            start = match.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def split_sentences(text: str) -> list[str]:
    """Sentences of `text` (stripped, non-empty), cut after terminal punctuation and newlines."""
    return [s.strip() for s in _cut_after(text, _SENTENCE_END) if s.strip()]


def load_text_tokenizer(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a `CosyVoice-BlankEN` directory with CosyVoice2's special tokens added."""
    # The class AutoTokenizer picks for the directory's "Qwen2Tokenizer" (the fast one, by that name or as
    # an alias), named directly: the Auto classes import transformers' model registry and generation
    # code (with scikit-learn where installed), ~3 s of every start on the GPU image. (transformers 5
    # keeps the Fast name as a runtime alias its type stubs do not declare.)
    from transformers import Qwen2TokenizerFast  # type: ignore[attr-defined]

    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"tokenizer directory {tokenizer_dir} does not exist")
    tokenizer = Qwen2TokenizerFast.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens(
        {"eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN, "additional_special_tokens": [*SPECIAL_TOKENS]}
    )
    return tokenizer


def load_backend_tokenizer(tokenizer_dir: Path, cache: Path | None = None) -> Tokenizer:
    """The Rust tokenizer behind `load_text_tokenizer(tokenizer_dir)` (`tokenizers.Tokenizer`: the same
    ids, vocabulary and decoding), which `TextFrontend` runs without transformers' per-call Python.

    With `cache`, it is kept there as JSON, named by a hash of the directory's files, the special tokens
    and the two libraries' versions: a later start reads that file instead of importing transformers to
    build it again (~1.5 s of a start). Decoding is the Rust tokenizer's, without the clean-up of spaces
    transformers applies when a tokenizer asks for it (CosyVoice-BlankEN does not).
    """
    from tokenizers import Tokenizer

    tokenizer_dir = Path(tokenizer_dir)
    if not tokenizer_dir.is_dir():
        raise FileNotFoundError(f"tokenizer directory {tokenizer_dir} does not exist")
    kept = None if cache is None else cache / f"text-tokenizer-{_tokenizer_key(tokenizer_dir)}.json"
    if kept is not None:
        try:
            if kept.is_file():
                return Tokenizer.from_file(str(kept))
        except Exception as exc:  # a torn or foreign file, an unreadable folder: build it again
            logger.warning("kept text tokenizer %s did not load (%s); building it again", kept.name, exc)
    built = load_text_tokenizer(tokenizer_dir)
    if not built.is_fast:
        raise TypeError(f"the tokenizer of {tokenizer_dir} has no fast (Rust) implementation")
    backend: Tokenizer = built.backend_tokenizer
    if kept is not None:
        try:
            write_whole(kept, backend.to_str().encode())
        except OSError as exc:  # a read-only models volume, a full disk: the start goes on
            logger.warning("text tokenizer not kept in %s (%s)", kept.parent, exc.strerror or exc)
    return backend


def _tokenizer_key(tokenizer_dir: Path) -> str:
    """What the built tokenizer depends on: the directory's tokenizer files (not its weights), how
    `load_text_tokenizer` builds it (`TOKENIZER_BUILD`), and the libraries' versions."""
    digest = hashlib.sha256(TOKENIZER_BUILD.encode())
    for path in sorted(p for p in tokenizer_dir.iterdir() if p.is_file() and p.suffix in (".json", ".txt")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    versions = (metadata.version("tokenizers"), metadata.version("transformers"))  # both declared
    for part in (EOS_TOKEN, *SPECIAL_TOKENS, *versions):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


class TextFrontend:
    """Tokenizer + normalisation + segmentation for one `CosyVoice-BlankEN` directory.

    `normalize` is applied by `prepare`/`split_segments` only; `encode` tokenizes exactly what it is given.
    `tokenizer_cache`: where the built tokenizer is kept for later starts (`load_backend_tokenizer`).
    """

    def __init__(
        self,
        tokenizer_dir: Path,
        normalize: Normalizer = collapse_whitespace,
        max_text_chars: int = DEFAULT_MAX_TEXT_CHARS,
        max_instruction_tokens: int = DEFAULT_MAX_INSTRUCTION_TOKENS,
        tokenizer_cache: Path | None = None,
    ) -> None:
        if max_text_chars <= 0 or max_instruction_tokens < 2:
            raise ValueError(f"need max_text_chars > 0 and max_instruction_tokens > 1, got {max_text_chars}, "
                             f"{max_instruction_tokens}")
        # Encoding runs on the event loop several times per request: the Rust tokenizer directly gives
        # the same ids without transformers' per-call Python (half the time).
        self._backend = load_backend_tokenizer(tokenizer_dir, tokenizer_cache)
        self._normalize = normalize
        self.max_text_chars = max_text_chars
        self.max_instruction_tokens = max_instruction_tokens
        self._endofprompt = self.token_id(ENDOFPROMPT)
        logger.info("text tokenizer %s: %d ids", tokenizer_dir, self.vocab_size)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added special tokens included (151663 for the released tokenizer)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def token_id(self, token: str) -> int:
        """Id of one special token such as `<|endofprompt|>`."""
        ids = self._backend.encode(token, add_special_tokens=False).ids
        if len(ids) != 1:
            raise KeyError(f"{token!r} is not a single token")
        return int(ids[0])

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` as given (no BOS/EOS, no normalisation)."""
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def encode_transcript(self, transcript: str) -> list[int]:
        """Token ids of a voice's transcript (the LLM prompt text), normalised as the reference normalises
        its prompt text: whole, with neither the inline-tag rule nor segmentation."""
        return self.encode(self._normalize(transcript))

    def decode(self, ids: Iterable[int]) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=False))

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def encode_instruction(self, instruction: str) -> list[int]:
        """Ids of an instruct2 instruction ending in `<|endofprompt|>`, or TextError.

        As in the reference, the instruction is not normalised. A trailing `<|endofprompt|>` (the
        reference's own convention) and any other prompt marker are removed before the service's own
        marker is appended.
        """
        if len(instruction) > 16 * self.max_instruction_tokens:  # before tokenizing megabytes
            raise TextError("instructions_too_long", f"instructions have {len(instruction)} characters; "
                                                     f"the limit is {self.max_instruction_tokens} tokens")
        words = PROMPT_MARKER.sub(" ", instruction).strip()
        if not words:
            raise TextError("empty_instructions", "instructions are empty or only whitespace")
        ids = [*self.encode(words), self._endofprompt]
        if len(ids) > self.max_instruction_tokens:
            raise TextError("instructions_too_long", f"instructions take {len(ids)} tokens; the limit is "
                                                     f"{self.max_instruction_tokens}")
        return ids

    def prepares_quickly(self, text: str, max_tokens: int) -> bool:
        """Whether `split_segments(text, max_tokens)` and encoding its pieces take a fraction of a
        millisecond, cheaper than handing them to a thread and back: a short text of a few sentences that
        makes one segment (no cut at clauses, words or characters, each a tokenizer call) and that the
        normaliser passes as quick (`collapse_whitespace` always; a hook with `normalises_quickly`, such
        as `ReferenceNormalizer`, when it says so; any other hook never)."""
        if len(text) > QUICK_TEXT_CHARS or not self._normalises_quickly(text):
            return False
        sentence_ends = itertools.islice(_SENTENCE_END.finditer(text), QUICK_TEXT_SENTENCES, None)
        return next(sentence_ends, None) is None and self.count(text) <= max_tokens

    def _normalises_quickly(self, text: str) -> bool:
        if self._normalize is collapse_whitespace:
            return True
        quick = getattr(self._normalize, "normalises_quickly", None)
        return bool(quick(text)) if callable(quick) else False

    def prepare(self, text: str) -> str:
        """Text with the inline-tag rule applied (`engines.inline_tags.clean_tags`) and normalised, or
        TextError if it is empty after that or longer than the limit."""
        if len(text) > self.max_text_chars:
            raise TextError(
                "text_too_long", f"text has {len(text)} characters; the limit is {self.max_text_chars}"
            )
        normalized = self._normalize(clean_tags(text))
        if not normalized.strip():
            raise TextError("empty_text", "text is empty or only whitespace")
        return normalized

    def split_segments(self, text: str, max_tokens: int = 80, merge_len: int = 20) -> list[str]:
        """`text` normalised and cut into segments of about `max_tokens` tokens at natural boundaries.

        Sentences are packed greedily up to `max_tokens`; a sentence longer than that is cut at
        clauses, then words, then characters. A segment shorter than `merge_len` tokens is merged into
        its neighbour, so a segment may exceed `max_tokens` by less than `merge_len`.
        """
        return [piece for piece, _ids in self.encode_segments(text, max_tokens, merge_len)]

    def encode_segments(self, text: str, max_tokens: int = 80,
                        merge_len: int = 20) -> list[tuple[str, list[int]]]:
        """`split_segments`'s pieces with their token ids. Cutting counts the same strings several times
        (a sentence as a unit, as the packed candidate, as a segment, then its ids): each string is
        encoded once per call."""
        if max_tokens <= 0 or merge_len < 0:
            raise ValueError(f"need max_tokens > 0 and merge_len >= 0, got {max_tokens}, {merge_len}")
        normalized = self.prepare(text)
        known: dict[str, list[int]] = {}

        def ids_of(piece: str) -> list[int]:
            ids = known.get(piece)
            if ids is None:
                ids = known[piece] = self.encode(piece)
            return ids

        def count(piece: str) -> int:
            return len(ids_of(piece))

        segments = self._pack(_cut_after(normalized, _SENTENCE_END), max_tokens, 0, count)
        return [(piece, ids_of(piece)) for piece in self._merge_short(segments, merge_len, count)]

    def _pack(self, units: list[str], max_tokens: int, depth: int, count: Callable[[str], int]) -> list[str]:
        """Greedily join adjacent `units` into stripped pieces of <= max_tokens tokens.

        A unit too long by itself is cut one level finer (clauses, words, characters); a single
        character or inline tag (`engines.inline_tags`) is never cut.
        """
        packed: list[str] = []
        current = ""
        for unit in units:
            finer = self._finer_units(unit, depth) if count(unit.strip()) > max_tokens else [unit]
            if len(finer) > 1:
                if current.strip():
                    packed.append(current.strip())
                current = ""
                packed.extend(self._pack(finer, max_tokens, depth + 1, count))
                continue
            candidate = current + unit
            if count(candidate.strip()) <= max_tokens:
                current = candidate
            else:
                if current.strip():
                    packed.append(current.strip())
                current = unit
        if current.strip():
            packed.append(current.strip())
        return packed

    @staticmethod
    def _finer_units(text: str, depth: int) -> list[str]:
        if depth == 0:
            pieces = _cut_after(text, _CLAUSE_END)
            if len(pieces) > 1:
                return pieces
        if depth <= 1:
            pieces = _cut_after(text, _WORD_END)
            if len(pieces) > 1:
                return pieces
        return _cut_after(text, _ANY_CHAR)

    @staticmethod
    def _merge_short(segments: list[str], merge_len: int, count: Callable[[str], int]) -> list[str]:
        merged: list[str] = []
        carry = ""
        for segment in segments:
            segment = f"{carry}{_separator(carry, segment)}{segment}" if carry else segment
            carry = ""
            if count(segment) < merge_len:
                carry = segment
            else:
                merged.append(segment)
        if carry:
            if merged:
                merged[-1] = f"{merged[-1]}{_separator(merged[-1], carry)}{carry}"
            else:
                merged.append(carry)
        return merged


def _separator(left: str, right: str) -> str:
    """A space between two pieces unless either side already has one or is CJK-adjacent."""
    if not left or not right or left[-1].isspace() or right[0].isspace():
        return ""
    if _is_cjk(left[-1]) or _is_cjk(right[0]):
        return ""
    return " "


def _is_cjk(char: str) -> bool:
    code = ord(char)
    return 0x3000 <= code <= 0x9FFF or 0xF900 <= code <= 0xFAFF or 0xFF00 <= code <= 0xFFEF


class StreamingSentenceSplitter:
    """Cuts text that arrives in pieces into sentences as soon as each one is complete.

    `feed` returns the sentences completed by the new piece; `flush` returns what is left. A sentence also
    ends where one piece ends with terminal punctuation and the next starts a new sentence without a
    space (`"today."` then `"Shall"`: clients that send one sentence per message). A buffer that grows
    past `max_chars` without a sentence end is cut at its last clause or word boundary, so a stream
    without punctuation still produces bounded segments.

    Besides whole sentences, the pending text can be cut early (`take_clause`, `take_words`, `take_all`):
    when to do so is the caller's policy (realtime/input_streaming.py); the splitter only finds the
    boundaries. Cuts never fall inside an inline tag or a short paired span.
    """

    def __init__(self, max_chars: int = 300) -> None:
        if max_chars <= 0:
            raise ValueError(f"max_chars must be positive, got {max_chars}")
        self.max_chars = max_chars
        self._buffer = ""
        self._joins: list[int] = []  # sentence ends found where two pieces meet (buffer positions)

    @property
    def pending(self) -> str:
        """Text received but not yet returned."""
        return self._buffer

    @property
    def ends_with_sentence_end(self) -> bool:
        """Whether the pending text ends in terminal punctuation that nothing has followed yet."""
        return bool(self._buffer.strip()) and _TRAILING_TERMINAL.search(self._buffer) is not None

    def whole_words(self) -> int:
        """Words of the pending text followed by whitespace (the last one may still grow)."""
        return len(_WORD_END.findall(self._buffer.lstrip()))

    def feed(self, piece: str) -> list[str]:
        if (
            piece
            and _TRAILING_TERMINAL.search(self._buffer)
            and _SENTENCE_START.match(piece)
            and not inside(protected_spans(self._buffer), len(self._buffer))
        ):
            self._joins.append(len(self._buffer))
        self._buffer += piece
        sentences: list[str] = []
        while True:
            end = self._complete_sentence_end()
            if end is None:
                break
            sentences.extend(self._take(end))
        return sentences

    def flush(self) -> list[str]:
        return self.take_all()

    def take_all(self) -> list[str]:
        """Everything pending (stripped), as one piece."""
        return self._take(len(self._buffer))

    def clause_words(self) -> int:
        """Words of the pending text before its last clause boundary (0 if it has none)."""
        end = self._last_clause_end()
        return 0 if end is None else len(self._buffer[:end].split())

    def take_clause(self) -> list[str]:
        """The pending text up to its last clause boundary (a comma, colon, ... followed by whitespace)."""
        end = self._last_clause_end()
        return [] if end is None else self._take(end)

    def _last_clause_end(self) -> int | None:
        spans = protected_spans(self._buffer)
        ends = [m.end() for m in _CLAUSE_END.finditer(self._buffer) if not inside(spans, m.end())]
        return ends[-1] if ends else None

    def take_words(self, max_words: int | None = None) -> list[str]:
        """The pending text's first `max_words` whole words (all of them if None); the word still
        growing at the end stays pending."""
        spans = protected_spans(self._buffer)
        ends = [m.start() for m in _WORD_END.finditer(self._buffer) if not inside(spans, m.start())]
        ends = [end for end in ends if self._buffer[:end].strip()]
        if not ends:
            return []
        return self._take(ends[-1] if max_words is None else ends[min(max_words, len(ends)) - 1])

    def _take(self, end: int) -> list[str]:
        piece, self._buffer = self._buffer[:end].strip(), self._buffer[end:]
        self._joins = [j - end for j in self._joins if j > end]
        return [piece] if piece else []

    def _complete_sentence_end(self) -> int | None:
        spans = protected_spans(self._buffer)
        ends = [j for j in self._joins[:1] if j < len(self._buffer)]
        for match in _SENTENCE_END.finditer(self._buffer):
            # A terminal run at the very end may still grow ("?!", a closing quote): wait for one more char.
            if match.end() < len(self._buffer) and not inside(spans, match.end()):
                ends.append(match.end())
                break
        if ends:
            return min(ends)
        if len(self._buffer) > self.max_chars:
            return self._overflow_cut(spans)
        return None

    def _overflow_cut(self, spans: list[tuple[int, int]]) -> int:
        head = self._buffer[: self.max_chars]
        for pattern in (_CLAUSE_END, _WORD_END):
            ends = [m.end() for m in pattern.finditer(head) if not inside(spans, m.end())]
            if ends and ends[-1] > 0:
                return ends[-1]
        return next((start for start, end in spans if start < self.max_chars < end and start > 0),
                    self.max_chars)
