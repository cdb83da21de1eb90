"""A small Qwen2-format BPE tokenizer trained on a built-in English corpus (synthetic model dirs only).

It is byte-level with Qwen2's normalizer and pre-tokenizer, so any text encodes, and it is saved as the
released `CosyVoice-BlankEN` files (vocab.json, merges.txt, tokenizer_config.json) that
`transformers.AutoTokenizer` loads as a `Qwen2Tokenizer`. Qwen2's three special tokens follow the
trained vocabulary, as in the real tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

# Qwen2's pre-tokenization pattern (contractions, letter runs, single digits, punctuation, whitespace).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CORPUS = """\
The quick brown fox jumps over the lazy dog while the morning sun rises above the quiet hills.
Realtime speech synthesis turns written words into natural sound with very little delay.
Every voice has its own colour, rhythm and pitch, and a good model keeps all of them.
Please read the following sentence slowly and clearly, then pause for a moment before you continue.
Numbers such as one, two, three, forty two and one hundred should be spoken the way people say them.
Where are you going this evening? I am going to the station to meet my sister and her friends.
What a wonderful surprise! Nobody expected the concert to start so early in the afternoon.
The weather today is cloudy with a chance of light rain in the north and bright spells in the south.
Our team built a small service that answers questions, tells stories and reads the news aloud.
She opened the window, listened to the birds in the garden and smiled at the warm spring air.
Thank you for calling; your request has been received and an agent will be with you shortly.
Can you hear me now? The connection was weak, but it seems much better than it was a minute ago.
Turn left at the second corner, walk past the bakery and the library, and the museum is on your right.
Learning a new language takes patience, practice and a great deal of listening to native speakers.
The children laughed, the dog barked, and for one happy moment the whole house was full of noise.
Streaming audio arrives in small chunks, so the listener hears the first words almost at once.
He wrote a long letter to his grandmother, describing the mountains, the lakes and the old villages.
Breakfast is served from seven until ten, and dinner starts at half past six in the main hall.
Scientists measured the temperature of the ocean every hour for three years to study the currents.
If you have any questions about your order, please visit our website or send us a short message.
The train to the city leaves from platform four at eight fifteen and arrives just before nine.
Music, poetry and theatre all depend on timing, and so does a voice that sounds truly human.
Yesterday we walked along the river, watched the boats and talked about books we love to read.
A clear, calm voice can make even a difficult message easier to understand and remember.
Engineers measure latency in milliseconds and throughput in requests per second under heavy load.
The orchestra tuned their violins, cellos and trumpets while the audience whispered in the balcony.
Fresh bread, ripe tomatoes, olive oil and a pinch of salt make a simple but delicious lunch.
Astronomers photographed a distant galaxy whose light travelled for billions of years to reach us.
Please remember to bring your passport, your ticket and a warm jacket for the journey north.
The committee postponed its decision because several members wanted more evidence and discussion.
Quietly, the cat climbed onto the bookshelf and knocked a porcelain vase onto the carpet.
Our neighbours planted cherry trees, sunflowers and lavender along the fence behind their cottage.
Mathematics describes patterns, symmetry and change with remarkable precision and elegance.
Hospitals need nurses, doctors, pharmacists and volunteers who stay calm during emergencies.
The documentary explored glaciers, volcanoes, deserts and rainforests across six continents.
Could you spell your surname, confirm your address and tell me which delivery day suits you best?
Thunder rumbled over the harbour as fishermen hurried to secure their nets and anchor the boats.
Developers wrote thorough tests, reviewed each change carefully and deployed the update on Friday.
My favourite recipe combines ginger, garlic, lemon and honey into a bright, fragrant sauce.
Journalists interviewed farmers about drought, harvest prices and the future of rural villages.
Imagine walking through a quiet forest at dawn, hearing only footsteps, wind and distant owls.
The bicycle needed new brakes, a stronger chain and slightly wider tyres for the gravel roads.
Volunteers cleaned the beach, collected plastic bottles and counted the seabirds nesting nearby.
A patient teacher explains difficult ideas with stories, drawings and plenty of encouragement.
Electric vehicles charge overnight, travel hundreds of kilometres and produce no exhaust fumes.
The museum displays ancient coins, jewellery, pottery and manuscripts from forgotten kingdoms.
Honestly, I never expected such a thoughtful gift; it made my whole week brighter and happier.
Rhythm, melody and harmony work together, yet silence between notes matters just as much.
Knowledge grows when curious people share questions, experiments, mistakes and discoveries freely.
Twelve zebras, seven giraffes and a sleepy hippopotamus gathered near the muddy waterhole.
"""


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE with Qwen2's normalizer and pre-tokenizer, trained on `CORPUS` (deterministic).

    The trained vocabulary may be smaller than `vocab_size` when the corpus runs out of merges.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer)
    return tokenizer


def write_qwen2_tokenizer(out_dir: Path, vocab_size: int = 1500, max_length: int = 32768) -> int:
    """Train and save a tokenizer directory in the released layout; returns the number of ids written."""
    tokenizer = train_tokenizer(vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.model.save(str(out_dir))
    base = tokenizer.get_vocab_size()
    added = {
        str(base + i): {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for i, token in enumerate(QWEN2_SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "model_max_length": max_length,
        "split_special_tokens": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return base + len(QWEN2_SPECIAL_TOKENS)
