"""Inline tags through the text front end (the rule of `engines.inline_tags`) and instruct2 instructions."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engines.build.tokenizer import write_qwen2_tokenizer
from engines.inline_tags import BRACKET_TAGS, PAIRED_TAGS, clean_tags, strip_tags
from engines.text import SPECIAL_TOKENS, StreamingSentenceSplitter, TextError, TextFrontend


@pytest.fixture(scope="module")
def frontend(tmp_path_factory: pytest.TempPathFactory) -> TextFrontend:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_qwen2_tokenizer(directory, vocab_size=1500)
    return TextFrontend(directory, max_instruction_tokens=40)


def test_the_tag_lists_are_the_tokenizers_tags() -> None:
    tags = [t for t in SPECIAL_TOKENS if t.startswith(("[", "<")) and not t.startswith("<|")]
    assert sorted(tags) == sorted([*BRACKET_TAGS, *(tag for pair in PAIRED_TAGS for tag in pair)])


@pytest.mark.parametrize(("text", "spoken"), [
    ("He stopped [laughter] and went on.", "He stopped [laughter] and went on."),
    ("A [Laughter] B [BREATH]", "A [laughter] B [breath]"),
    ("<strong>Never</strong> again", "<strong>Never</strong> again"),
    ("<Laughter>so funny</LAUGHTER>", "<laughter>so funny</laughter>"),
    ("[music] Welcome back", " Welcome back"),  # unknown tag: dropped
    ("<em>really</em> good", "really good"),  # unknown markup: dropped, its words kept
    ("see [1] and [page 3]", "see [1] and [page 3]"),  # not tag-shaped: spoken
    ("a < b and c > d", "a < b and c > d"),
    ("Hi<|endofprompt|> there <|im_start|>", "Hi there "),  # prompt markers: dropped
])
def test_known_tags_pass_and_unknown_ones_are_dropped(text: str, spoken: str) -> None:
    assert clean_tags(text) == spoken


def test_tags_reach_the_tokenizer_as_their_single_ids(frontend: TextFrontend) -> None:
    text = frontend.prepare("It was [LAUGHTER] <strong>so</strong> good [music].")
    ids = frontend.encode(text)
    for tag in ("[laughter]", "<strong>", "</strong>"):
        assert ids.count(frontend.token_id(tag)) == 1
    assert "[music]" not in text


def _tag_pieces(text: str) -> list[str]:
    """Every tag and paired span of `text`, as written."""
    pattern = "|".join([*(re.escape(t) for t in BRACKET_TAGS),
                        *(f"{re.escape(a)}.*?{re.escape(b)}" for a, b in PAIRED_TAGS)])
    return re.findall(pattern, text, re.DOTALL)


TAGGED = ("She read it twice [breath] and then, <strong>slowly. Very slowly.</strong> she smiled [laughter]. "
          "<laughter>That was the plan, wasn't it?</laughter> [sigh] Next sentence here; and more [cough] "
          "words follow until the budget runs out [quick_breath] again.")


@pytest.mark.parametrize("max_tokens", [6, 12, 40, 80])
def test_segmentation_never_cuts_inside_a_tag_or_a_short_paired_span(frontend: TextFrontend,
                                                                     max_tokens: int) -> None:
    segments = frontend.split_segments(TAGGED, max_tokens=max_tokens, merge_len=2)
    whole = _tag_pieces(TAGGED)
    found = [piece for segment in segments for piece in _tag_pieces(segment)]
    assert found == whole
    assert "".join("".join(segments).split()) == "".join(TAGGED.split())


def test_characters_cuts_keep_tags_whole(frontend: TextFrontend) -> None:
    text = "[laughter]" + "字" * 30 + "[breath]" + "字" * 30
    segments = frontend.split_segments(text, max_tokens=5, merge_len=0)
    assert _tag_pieces("".join(segments)) == ["[laughter]", "[breath]"]
    assert all(_tag_pieces(s) or "[" not in s for s in segments)


@settings(max_examples=60, deadline=None)
@given(st.integers(min_value=1, max_value=40))
def test_streaming_sentences_keep_paired_spans_whole_for_any_piece_size(piece: int) -> None:
    splitter = StreamingSentenceSplitter(max_chars=120)
    sentences = []
    for start in range(0, len(TAGGED), piece):
        sentences += splitter.feed(TAGGED[start:start + piece])
    sentences += splitter.flush()
    assert [p for s in sentences for p in _tag_pieces(s)] == _tag_pieces(TAGGED)
    assert sentences[0].endswith("<strong>slowly. Very slowly.</strong> she smiled [laughter].")


def test_word_timings_see_words_not_tags() -> None:
    assert strip_tags("[breath] so <strong>very</strong> good").split() == ["so", "very", "good"]


def test_an_instruction_ends_in_one_endofprompt(frontend: TextFrontend) -> None:
    end = frontend.token_id("<|endofprompt|>")
    ids = frontend.encode_instruction("Speak slowly and calmly.")
    assert ids == [*frontend.encode("Speak slowly and calmly."), end]
    # The reference's own convention (the user typed the marker) gives the same ids; other markers go.
    assert frontend.encode_instruction("Speak slowly and calmly.<|endofprompt|>") == ids
    assert frontend.encode_instruction("<|im_start|>Speak slowly and calmly.<|endofprompt|>") == ids


def test_instructions_empty_or_too_long_are_refused(frontend: TextFrontend) -> None:
    for empty in ("", "   ", "<|endofprompt|>"):
        with pytest.raises(TextError) as refused:
            frontend.encode_instruction(empty)
        assert refused.value.code == "empty_instructions"
    for long in ("word " * 100, "x" * 100_000):
        with pytest.raises(TextError) as too_long:
            frontend.encode_instruction(long)
        assert too_long.value.code == "instructions_too_long" and "limit is" in str(too_long.value)


def test_unknown_bracket_rule_survives_tokenization(tmp_path: Path, frontend: TextFrontend) -> None:
    spoken = frontend.prepare("Footnote [12] says [applause] hi")
    assert spoken == "Footnote [12] says hi"


@pytest.mark.parametrize("text", [
    "It cost 25 dollars [laughter] on 3 May, <strong>12 times</strong> more [breath].",
    "他笑了[laughter]，说了3次<strong>好的</strong>[breath]。",
])
def test_tags_survive_the_reference_normalisation_and_segmentation(tmp_path: Path, text: str) -> None:
    from engines.normalize import ReferenceNormalizer

    write_qwen2_tokenizer(tmp_path, vocab_size=1500)
    front = TextFrontend(tmp_path, ReferenceNormalizer())
    segments = front.split_segments(text, max_tokens=8, merge_len=0)
    spoken = "".join(segments)
    known = (*BRACKET_TAGS, *(tag for pair in PAIRED_TAGS for tag in pair))
    tags = re.compile("|".join(re.escape(tag) for tag in known))
    assert tags.findall(spoken) == tags.findall(text)
    # Every paired span still within one segment.
    assert sum(len(_tag_pieces(segment)) for segment in segments) == len(_tag_pieces(text))
    assert "25" not in spoken and "3" not in spoken  # the numbers were normalised around the tags
    for segment in segments:
        ids = front.encode(segment)
        assert ids.count(front.token_id("[breath]")) == segment.count("[breath]")
