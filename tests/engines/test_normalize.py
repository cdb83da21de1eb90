"""Text normalisation as CosyVoice's front end does it (wetext path): expected outputs written out.

The expected strings are what CosyVoice's `text_normalize` produces with wetext's transducers (the ones
wetext ships), `inflect` for leftover digits and its Chinese clean-ups; wetext only runs on text with a
digit, as wetext 0.0.4 (the reference's pin) does.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from engines.build.tokenizer import write_qwen2_tokenizer
from engines.normalize import WINDOW_CHARS, ReferenceNormalizer, _windows, detect_language
from engines.text import SPECIAL_TOKENS, StreamingSentenceSplitter, TextFrontend


@pytest.fixture(scope="module")
def normalize() -> ReferenceNormalizer:
    return ReferenceNormalizer()


ENGLISH = [
    ("I have 3 cats and 12 dogs.", "I have three cats and twelve dogs."),
    # currency and a slash date: what the issue heard read wrongly
    ("It costs $5.30 on 3/4.", "It costs five point three dollars on three quarters."),
    ("It costs $5.", "It costs five dollars."),
    ("Born on Jan. 5, 2024.", "Born on the fifth of january, twenty twenty four."),
    ("The year 1999.", "The year nineteen ninety nine."),
    ("The meeting is at 10:30 am.", "The meeting is at ten thirty AM."),
    ("We met at 7 pm.", "We met at seven PM."),
    ("She came 1st, he came 22nd.", "She came first, he came twenty second."),
    ("A 5 kg bag, 3.5 km away, 12.5% off.",
     "A five kilograms bag, three point five kilometers away, twelve point five percent off."),
    ("Pi is 3.14.", "Pi is three point one four."),
    ("Call 555-1234.", "Call five hundred and fifty five to one thousand two hundred and thirty four."),
    ("Dr. Smith has 2 kids.", "doctor Smith has two kids."),
    # no digit: wetext does not run (wetext 0.0.4's rule), so the abbreviation and the URL stay
    ("Dr. Smith is here.", "Dr. Smith is here."),
    ("Visit https://example.com/docs now.", "Visit https://example.com/docs now."),
    ("Wait, what?", "Wait, what?"),
    # digits beyond inflect's named powers: read one by one
    ("Code " + "1234567890" * 7 + ".",
     "Code " + " ".join(["one two three four five six seven eight nine oh"] * 7) + "."),
]

CHINESE = [
    ("今天是2024年3月4日。", "今天是二零二四年三月四日。"),
    ("气温25.5°C。", "气温二十五点五摄氏度。"),
    ("下午3:30开会。", "下午三点三十分开会。"),
    ("打折50%。", "打折百分之五十。"),
    ("花了30元。", "花了三十元。"),
    ("他是第1名。", "他是第一名。"),
    ("面积是10m²。", "面积是十平方米。"),
    # the clean-ups: trailing comma → 。, blanks between Chinese dropped, brackets and —— removed, . → 。
    ("我有2个苹果和3个梨，", "我有两个苹果和三个梨。"),
    ("你好 世界", "你好世界"),
    ("（注意）【重要】这是——测试。", "注意重要这是 测试。"),
    ("请看第3.5节.", "请看第三点五节。"),
    # mixed: any Chinese character makes the whole text Chinese; blanks between ASCII words stay
    ("我用iPhone 15拍的照片，", "我用iPhone十五拍的照片。"),
    ("我喜欢 New York 的冬天", "我喜欢New York的冬天"),
]


@pytest.mark.parametrize(("text", "expected"), ENGLISH)
def test_english(normalize: ReferenceNormalizer, text: str, expected: str) -> None:
    assert normalize(text) == expected


@pytest.mark.parametrize(("text", "expected"), CHINESE)
def test_chinese(normalize: ReferenceNormalizer, text: str, expected: str) -> None:
    assert normalize(text) == expected


def test_a_url_with_digits_is_spelled_out(normalize: ReferenceNormalizer) -> None:
    assert normalize("Visit https://example.com/a?b=1 now") == (
        "Visit HTTPS colon slash slash example dot com slash a question mark b equal sign one now"
    )


@pytest.mark.parametrize(
    ("text", "language"),
    [
        ("hello world", "en"),
        ("你好", "zh"),
        ("Mixed 中文 text", "zh"),
        ("日本語", "zh"),  # kanji are CJK unified ideographs
        ("こんにちは", "en"),  # kana are not: the reference's rule reads them as not Chinese
        ("안녕하세요", "en"),
        ("１２３", "en"),  # full-width digits are not ideographs
        ("", "en"),
    ],
)
def test_language_detection_is_the_reference_rule(text: str, language: str) -> None:
    assert detect_language(text) == language


INLINE_TAGS = [tag for tag in SPECIAL_TOKENS if not tag.startswith("<|")]


@pytest.mark.parametrize("tag", INLINE_TAGS)
def test_inline_tags_pass_untouched(normalize: ReferenceNormalizer, tag: str) -> None:
    assert normalize(f"I have 2 {tag} cats and 3 dogs.") == f"I have two {tag} cats and three dogs."
    assert normalize(f"{tag}Take 12.") == f"{tag}Take twelve."
    assert normalize(f"我有2个{tag}苹果。") == f"我有两个{tag}苹果。"


def test_tags_around_words_keep_their_spacing(normalize: ReferenceNormalizer) -> None:
    text = "[laughter] I paid $5 <strong>today</strong>, [breath] not 6."
    assert normalize(text) == "[laughter] I paid five dollars <strong>today</strong>, [breath] not six."


def test_model_markup_skips_normalisation(normalize: ReferenceNormalizer) -> None:
    assert normalize("<|endofprompt|> 5 cats") == "<|endofprompt|> 5 cats"


def test_whitespace_is_collapsed_and_lines_are_kept(normalize: ReferenceNormalizer) -> None:
    assert normalize("  Room   101\n\n floor 3 ") == "Room one hundred and one\nfloor three"


def test_long_text_is_normalised_in_windows_of_whole_sentences(normalize: ReferenceNormalizer) -> None:
    sentence = "I bought 3 apples on Jan. 5, 2024."
    text = " ".join([sentence] * (3 * WINDOW_CHARS // len(sentence)))
    expected = " ".join(["I bought three apples on the fifth of january, twenty twenty four."] * (
        3 * WINDOW_CHARS // len(sentence)))
    assert normalize(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "12 " * 300,  # no sentence end at all
        "5" * 1000,  # no break at all
        "x" * 150 + "[laughter]" + "y" * 300,  # a hard cut would fall next to a tag
        "y" * 155 + "[vocalized-noise]" + "z" * 300,  # … or inside one
        "Short one. Another!\nNew line. " + "w" * 200 + ". End.",
    ],
)
def test_windows_are_bounded_and_keep_the_text_and_its_tags(text: str) -> None:
    # wetext's cost grows faster than its input: no window may be much longer than WINDOW_CHARS.
    windows = _windows(text)
    assert "".join(windows) == text
    assert max(len(window) for window in windows) <= WINDOW_CHARS + 1
    for tag in ("[laughter]", "[vocalized-noise]"):
        assert sum(window.count(tag) for window in windows) == text.count(tag)


def test_a_long_text_without_sentence_ends_is_normalised_whole(normalize: ReferenceNormalizer) -> None:
    assert normalize("12 " * 200) == " ".join(["twelve"] * 200)


def test_streamed_sentences_are_normalised_as_they_are_cut(normalize: ReferenceNormalizer) -> None:
    text = "It costs $5. [laughter] Really, 12 of them? 我有2个苹果。 Done at 10:30 am."
    splitter = StreamingSentenceSplitter()
    spoken: list[str] = []
    for start in range(0, len(text), 3):
        spoken += [normalize(sentence) for sentence in splitter.feed(text[start : start + 3])]
    spoken += [normalize(sentence) for sentence in splitter.flush()]
    assert spoken == [
        "It costs five dollars.",
        "[laughter] Really, twelve of them?",
        "我有两个苹果。",
        "Done at ten thirty AM.",
    ]


def test_the_text_frontend_tokenises_normalised_text_with_tags_as_single_ids(
    normalize: ReferenceNormalizer, tmp_path: Path
) -> None:
    write_qwen2_tokenizer(tmp_path, vocab_size=1500)
    frontend = TextFrontend(tmp_path, normalize)
    (segment,) = frontend.split_segments("I paid $5 [laughter] for 2 <strong>cats</strong>.")
    assert segment == "I paid five dollars [laughter] for two <strong>cats</strong>."
    ids = frontend.encode(segment)
    for tag in ("[laughter]", "<strong>", "</strong>"):
        assert frontend.token_id(tag) in ids


def test_a_voice_transcript_is_normalised_whole(normalize: ReferenceNormalizer, tmp_path: Path) -> None:
    # The reference normalises its prompt text too (text_normalize(prompt_text, split=False)).
    write_qwen2_tokenizer(tmp_path, vocab_size=1500)
    frontend = TextFrontend(tmp_path, normalize)
    transcript = "It costs $5.  I counted 12 of them."
    assert frontend.encode_transcript(transcript) == frontend.encode(
        "It costs five dollars. I counted twelve of them."
    )


def test_inflect_is_imported_without_typeguard_and_spells_as_the_instrumented_one() -> None:
    """In fresh interpreters: `import_inflect` leaves inflect's engine without typeguard's inserted checks
    and restores `typeguard.typechecked`; inflect imported as usual has the checks; both spell the same."""
    import json
    import os
    import subprocess
    import sys

    script = textwrap.dedent("""
        import json, sys, typeguard
        original = typeguard.typechecked
        if sys.argv[1] == "ours":
            from engines.normalize import import_inflect
            inflect = import_inflect()
        else:
            import inflect
        names = inflect.engine.number_to_words.__code__.co_names
        print(json.dumps({"restored": typeguard.typechecked is original,
                          "checked": any(name.startswith("check_") for name in names),
                          "words": [inflect.engine().number_to_words(n) for n in ("12", "2024", "1000001")]}))
    """)
    root = Path(__file__).resolve().parents[2]
    reports = {}
    for way in ("ours", "usual"):
        run = subprocess.run([sys.executable, "-c", script, way], cwd=root, capture_output=True, text=True,
                             check=False, env={**os.environ, "PYTHONPATH": str(root)})
        assert run.returncode == 0, run.stderr[-2000:]
        reports[way] = json.loads(run.stdout.strip().splitlines()[-1])
    assert reports["ours"]["restored"] and not reports["ours"]["checked"]
    assert reports["usual"]["checked"]  # what the first assertion would miss if typeguard renamed its checks
    assert reports["ours"]["words"] == reports["usual"]["words"]


def test_only_text_with_digits_goes_to_wetext(normalize: ReferenceNormalizer) -> None:
    """What `normalises_quickly` promises (sessions cut such text on the event loop): text without a digit,
    in any script, comes back from the cheap path; any Unicode digit may take wetext's."""
    for quick in ("Thanks for calling, how can I help?", "谢谢您的来电。", "Café au lait, s'il vous plaît."):
        assert normalize.normalises_quickly(quick) and normalize(quick) == quick
    for digits in ("Table for 4.", "Room ٤ please.", "第3个"):
        assert not normalize.normalises_quickly(digits)
