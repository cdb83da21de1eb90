"""Text front end on a small trained Qwen2-format tokenizer (the synthetic models' tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engines.build.tokenizer import write_qwen2_tokenizer
from engines.text import (
    QUICK_TEXT_CHARS,
    SPECIAL_TOKENS,
    StreamingSentenceSplitter,
    TextError,
    TextFrontend,
    collapse_whitespace,
    load_text_tokenizer,
    split_sentences,
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    write_qwen2_tokenizer(directory, vocab_size=1500)
    return directory


@pytest.fixture(scope="module")
def frontend(tokenizer_dir: Path) -> TextFrontend:
    return TextFrontend(tokenizer_dir)


def _words(text: str) -> str:
    return "".join(text.split())


def test_special_tokens_follow_the_base_vocabulary_in_order(
    frontend: TextFrontend, tokenizer_dir: Path
) -> None:
    base = len(json.loads((tokenizer_dir / "vocab.json").read_text()))
    # Qwen2's own specials come first, then CosyVoice2's additions in their listed order.
    assert frontend.token_id("<|endoftext|>") == base
    assert frontend.token_id("<|im_start|>") == base + 1
    assert frontend.token_id("<|im_end|>") == base + 2
    added = [frontend.token_id(t) for t in SPECIAL_TOKENS[2:]]
    assert added == list(range(base + 3, base + 3 + len(added)))
    assert frontend.vocab_size == base + 3 + len(added)


def test_tokenizer_is_the_one_auto_tokenizer_picks(tokenizer_dir: Path) -> None:
    # The loader names the class to skip the Auto machinery's imports; it must stay the class (and so the
    # ids) that transformers' AutoTokenizer chooses for the directory's tokenizer_config.json.
    from transformers import AutoTokenizer

    ours = load_text_tokenizer(tokenizer_dir)
    auto = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert type(ours) is type(auto)
    for text in ("Hello there, how are you?", "你好，世界！ 42 🎉", "a  b\tc\nd", "It's 3:45pm; ok?"):
        assert ours(text)["input_ids"] == auto(text)["input_ids"]


def test_encode_adds_no_bos_or_eos_and_round_trips(frontend: TextFrontend) -> None:
    assert frontend.encode("") == []
    for text in ("Hello there, how are you?", "你好，世界！", "Zebra quartz 42 🎉", "a  b\tc\nd"):
        ids = frontend.encode(text)
        assert frontend.decode(ids) == text
        assert frontend.token_id("<|endoftext|>") not in ids


def test_special_tokens_encode_as_single_ids(frontend: TextFrontend) -> None:
    ids = frontend.encode("hello[breath]world<|endofprompt|>")
    assert frontend.token_id("[breath]") in ids
    assert ids[-1] == frontend.token_id("<|endofprompt|>")


def test_prepare_normalises_and_rejects_empty_or_long_text(tokenizer_dir: Path) -> None:
    frontend = TextFrontend(tokenizer_dir, max_text_chars=20)
    assert frontend.prepare("  hi \t there \n\n now ") == "hi there\nnow"
    for empty in ("", "   \n\t "):
        with pytest.raises(TextError) as info:
            frontend.prepare(empty)
        assert info.value.code == "empty_text"
    with pytest.raises(TextError) as info:
        frontend.prepare("x" * 21)
    assert info.value.code == "text_too_long"


def test_only_short_text_that_makes_one_segment_prepares_quickly(frontend: TextFrontend) -> None:
    """Sessions cut such text on the event loop: a few sentences within one segment's tokens, with a
    normaliser that says it is quick. Anything that would be cut finer (one tokenizer call per clause,
    word or character: milliseconds for 200 characters without spaces) goes to a worker thread."""
    assert frontend.prepares_quickly("Thanks for calling, how can I help you today?", 80)
    assert frontend.prepares_quickly("谢谢您的来电。", 80)
    assert frontend.prepares_quickly("x" * QUICK_TEXT_CHARS, 10_000)
    assert not frontend.prepares_quickly("x" * (QUICK_TEXT_CHARS + 1), 10_000)
    for slow in ("abcdefghij" * 20, "谢" * 199, "😀" * 200, "." * 200, "Yes. No. Maybe. " * 4):
        assert not frontend.prepares_quickly(slow, 80), slow[:20]
    assert not frontend.prepares_quickly("Thanks for calling, how can I help you today?", 5)


def test_a_normalisation_hook_prepares_quickly_only_when_it_says_so(tokenizer_dir: Path) -> None:
    class Declared:
        def __call__(self, text: str) -> str:
            return collapse_whitespace(text)

        def normalises_quickly(self, text: str) -> bool:
            return "#" not in text

    assert not TextFrontend(tokenizer_dir, normalize=lambda text: text).prepares_quickly("Hi there.", 80)
    declared = TextFrontend(tokenizer_dir, normalize=Declared())
    assert declared.prepares_quickly("Hi there.", 80)
    assert not declared.prepares_quickly("Hi #1 there.", 80)


def test_normalisation_hook_is_applied(tokenizer_dir: Path) -> None:
    def spell_ampersand(text: str) -> str:
        return collapse_whitespace(text.replace("&", " and "))

    frontend = TextFrontend(tokenizer_dir, normalize=spell_ampersand)
    assert frontend.prepare("salt & pepper") == "salt and pepper"
    assert frontend.split_segments("salt & pepper.") == ["salt and pepper."]


def test_split_sentences_at_terminal_punctuation() -> None:
    assert split_sentences("Hello world. It is 3.14 today! Is it? Yes;  fine") == [
        "Hello world.", "It is 3.14 today!", "Is it?", "Yes;", "fine"]
    assert split_sentences("你好。今天天气很好！真的吗？") == ["你好。", "今天天气很好！", "真的吗？"]
    assert split_sentences('He said "stop." Then left.\nNew line') == [
        'He said "stop."', "Then left.", "New line"]


def test_segments_respect_the_token_budget_and_keep_all_text(frontend: TextFrontend) -> None:
    text = " ".join(f"Sentence number {i} talks about the weather and the river." for i in range(30))
    segments = frontend.split_segments(text, max_tokens=40, merge_len=10)
    assert len(segments) > 1
    assert all(frontend.count(s) <= 40 + 10 for s in segments)
    assert all(s.endswith(".") for s in segments)  # cut at sentence ends only
    assert _words("".join(segments)) == _words(text)


def test_a_long_sentence_is_cut_at_words_and_a_short_tail_is_merged(frontend: TextFrontend) -> None:
    text = "word " * 200 + "end. Ok."
    segments = frontend.split_segments(text, max_tokens=30, merge_len=8)
    assert len(segments) > 3
    assert all(frontend.count(s) <= 30 + 8 for s in segments)
    assert segments[-1].endswith("end. Ok.")  # "Ok." alone is below merge_len
    assert _words(" ".join(segments)) == _words(text)


def test_cjk_without_spaces_is_cut_into_bounded_segments(frontend: TextFrontend) -> None:
    text = "今天天气很好我们去公园散步吧" * 10 + "。好的。"
    segments = frontend.split_segments(text, max_tokens=25, merge_len=5)
    assert all(frontend.count(s) <= 30 for s in segments)
    assert "".join(segments) == text


@pytest.mark.parametrize("text", [
    "Thanks for calling, how can I help you today?",
    " ".join(f"Sentence number {i} talks about the weather." for i in range(12)) + " Ok.",
    "word " * 120 + "end. Ok.",
])
def test_segments_come_with_their_ids_and_each_string_is_encoded_once(frontend: TextFrontend,
                                                                      monkeypatch, text: str) -> None:
    expected = [(piece, frontend.encode(piece)) for piece in frontend.split_segments(text, 30, 8)]
    encoded: list[str] = []
    encode = frontend.encode

    def counting(piece: str) -> list[int]:
        encoded.append(piece)
        return encode(piece)

    monkeypatch.setattr(frontend, "encode", counting)
    assert frontend.encode_segments(text, 30, 8) == expected
    assert len(encoded) == len(set(encoded))
    if text.startswith("Thanks"):  # one sentence: unit, candidate, segment and its ids are one string
        assert encoded == [text]


def test_short_text_is_one_segment(frontend: TextFrontend) -> None:
    assert frontend.split_segments("  Hello.  ") == ["Hello."]


def test_streaming_splitter_emits_each_sentence_when_complete() -> None:
    splitter = StreamingSentenceSplitter()
    assert splitter.feed("Hello wor") == []
    assert splitter.feed("ld. It is 3") == ["Hello world."]
    assert splitter.feed(".14 today") == []  # "3." followed by a digit is no sentence end
    assert splitter.feed("! 你好。") == ["It is 3.14 today!"]
    assert splitter.feed("再") == ["你好。"]  # a CJK end is complete once anything follows it
    assert splitter.feed("见") == []
    assert splitter.flush() == ["再见"]
    assert splitter.flush() == []


def test_streaming_splitter_matches_the_batch_split_for_any_piece_size() -> None:
    text = "One. Two?! Three; four.\nFive 5.5 six. 七。八！ nine"
    for size in (1, 2, 3, 7, len(text)):
        splitter = StreamingSentenceSplitter()
        out = [s for i in range(0, len(text), size) for s in splitter.feed(text[i:i + size])]
        assert out + splitter.flush() == split_sentences(text)


def test_streaming_splitter_bounds_text_without_punctuation() -> None:
    text = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod"
    splitter = StreamingSentenceSplitter(max_chars=30)
    out = splitter.feed(text)
    assert out and all(len(s) <= 30 for s in out)
    assert _words("".join(out + splitter.flush())) == _words(text)


def test_streaming_splitter_cuts_where_a_piece_starts_a_new_sentence_without_a_space():
    splitter = StreamingSentenceSplitter()
    assert splitter.feed("It is sunny today.") == []
    assert splitter.ends_with_sentence_end
    assert splitter.feed("Shall we go?") == ["It is sunny today."]
    assert splitter.feed("no") == []  # lower case: the same sentence goes on ("go?no")
    assert splitter.flush() == ["Shall we go?no"]
    assert splitter.feed("Pi is 3.") == [] and splitter.feed("14 exactly") == []
    assert splitter.flush() == ["Pi is 3.14 exactly"]


def test_streaming_splitter_offers_clause_and_word_cuts_of_the_pending_text():
    splitter = StreamingSentenceSplitter()
    assert splitter.feed("Well, I think that the weather, all things consid") == []
    assert splitter.whole_words() == 8 and splitter.clause_words() == 6
    assert splitter.take_clause() == ["Well, I think that the weather,"]
    assert splitter.take_words(2) == ["all things"]
    assert splitter.take_words() == []  # only the growing word is left
    assert splitter.pending == " consid"
    assert splitter.take_all() == ["consid"] and splitter.pending == ""


TOKENIZER_TEXTS = ("Hello there, how are you?", "你好，世界！ 42 🎉", "a  b\tc\nd", "It's 3:45pm; ok?",
                   "[laughter] so <strong>this</strong> is it<|endofprompt|>", "")


def test_a_kept_tokenizer_is_read_back_without_transformers_and_equals_it(
    tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = TextFrontend(tokenizer_dir, tokenizer_cache=tmp_path)
    assert len(list(tmp_path.glob("text-tokenizer-*.json"))) == 1
    reference = load_text_tokenizer(tokenizer_dir)

    def no_transformers(directory: Path) -> None:
        raise AssertionError("a kept tokenizer needs no transformers")

    monkeypatch.setattr("engines.text.load_text_tokenizer", no_transformers)
    kept = TextFrontend(tokenizer_dir, tokenizer_cache=tmp_path)
    assert kept.vocab_size == built.vocab_size == len(reference)
    for text in TOKENIZER_TEXTS:
        ids = reference.encode(text, add_special_tokens=False)
        assert kept.encode(text) == built.encode(text) == ids
        assert kept.decode(ids) == reference.decode(ids)
    assert kept.token_id("<|endofprompt|>") == built.token_id("<|endofprompt|>")


def test_a_changed_tokenizer_directory_is_kept_under_another_name(tmp_path: Path) -> None:
    directory = tmp_path / "tokenizer"
    write_qwen2_tokenizer(directory, vocab_size=1500)
    TextFrontend(directory, tokenizer_cache=tmp_path / "cache")
    config = directory / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": 4096}))
    TextFrontend(directory, tokenizer_cache=tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("text-tokenizer-*.json"))) == 2


def test_a_torn_kept_tokenizer_is_built_again(
    tokenizer_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    TextFrontend(tokenizer_dir, tokenizer_cache=tmp_path)
    [kept] = tmp_path.glob("text-tokenizer-*.json")
    kept.write_text('{"version": "1.0", "trunc')
    with caplog.at_level("WARNING", logger="engines.text"):
        frontend = TextFrontend(tokenizer_dir, tokenizer_cache=tmp_path)
    assert "did not load" in caplog.text
    assert frontend.encode("Hello there") == load_text_tokenizer(tokenizer_dir).encode("Hello there",
                                                                                     add_special_tokens=False)
    TextFrontend(tokenizer_dir, tokenizer_cache=tmp_path)  # the rebuilt file reads back


def test_a_start_with_a_kept_tokenizer_never_imports_transformers(
    tokenizer_dir: Path, tmp_path: Path
) -> None:
    """What the cache is for: in a fresh interpreter, the front end comes up without transformers."""
    import os
    import subprocess
    import sys
    import textwrap

    TextFrontend(tokenizer_dir, tokenizer_cache=tmp_path)
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from engines.text import TextFrontend
        frontend = TextFrontend(Path({str(tokenizer_dir)!r}), tokenizer_cache=Path({str(tmp_path)!r}))
        print(frontend.encode("Hello there"), "transformers" in sys.modules)
    """)
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True, text=True,
                         check=False, env={**os.environ, "PYTHONPATH": str(root)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().endswith("False")
