"""Incremental detokenization: streamed pieces join to the full decode, and valid UTF-8
split across tokens never shows U+FFFD mid-stream. On the embedded byte-level tokenizer
and on two tokenizers trained here in the shapes real models use (byte-level BPE with
merges, as GPT-2/Qwen2; SentencePiece-style BPE with byte fallback, as Llama/Mistral)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from workers.engine.detokenizer import IncrementalDetokenizer

CORPUS = ["Hello world, 你好世界 😀 emoji 🎉 naïve café — über straße 日本語のテキスト 한국어"] * 50
SAMPLES = [
    "plain ascii, nothing odd",
    "emoji 😀🎉👩‍👩‍👧 and flags 🇯🇵",
    "中文字符和日本語のテキスト、한국어",
    "mixed: naïve café 😀 中 x ǅ",
    "  leading spaces and\nnewlines\n\n",
]


@pytest.fixture(scope="module")
def byte_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def bpe_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|end|>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=420, special_tokens=["<s>", "</s>", *byte_tokens], limit_alphabet=60))
    # The trainer only seeds the vocabulary with the byte tokens as specials; in Llama's
    # tokenizer they are ordinary tokens, which decoding must not skip.
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in ("<s>", "</s>")]
    tok = Tokenizer.from_str(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")


TOKENIZERS = ["byte_tokenizer", "bpe_tokenizer", "sentencepiece_tokenizer"]


def _stream(tokenizer, token_ids, prompt_token_ids=None) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
    return [detok.push(t) for t in token_ids] + [detok.flush()]


def _assert_clean_stream(tokenizer, text: str) -> None:
    """Streamed pieces join to the full decode and none shows a replacement character.

    Text that spells a special token (``<|im_start|>``) encodes to it, and a stream skips
    special tokens, so the comparison is with a decode that skips them too.
    """
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(tokenizer, token_ids)
    assert "".join(pieces) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("text", SAMPLES)
def test_stream_joins_to_full_decode_without_replacement_chars(request, name, text):
    _assert_clean_stream(request.getfixturevalue(name), text)


def test_byte_tokenizer_holds_multibyte_characters_until_complete(byte_tokenizer):
    token_ids = byte_tokenizer.encode("a中😀", add_special_tokens=False)
    assert len(token_ids) == 1 + 3 + 4  # one token per byte
    assert _stream(byte_tokenizer, token_ids) == ["a", "", "", "中", "", "", "", "😀", ""]


@pytest.mark.parametrize("name", ["bpe_tokenizer", "sentencepiece_tokenizer"])
def test_prompt_context_keeps_leading_space_of_first_word(request, name):
    tokenizer = request.getfixturevalue(name)
    full = tokenizer.encode("Hello world 世界 again", add_special_tokens=False)
    for split in range(1, len(full)):
        prompt, output = full[:split], full[split:]
        streamed = "".join(_stream(tokenizer, output, prompt))
        # A character cut by the split belongs to the output, which completes it.
        prompt_text = tokenizer.decode(prompt).rstrip("\ufffd")
        assert prompt_text + streamed == tokenizer.decode(full)


def test_special_tokens_are_skipped(byte_tokenizer):
    token_ids = byte_tokenizer.encode("hi", add_special_tokens=False) + [byte_tokenizer.eos_token_id]
    assert "".join(_stream(byte_tokenizer, token_ids)) == "hi"


def test_invalid_bytes_flush_as_replacement(byte_tokenizer):
    # A lone lead byte of a 3-byte character at the end: held, then U+FFFD at flush.
    assert _stream(byte_tokenizer, [ord("x"), 0xE4]) == ["x", "", "\ufffd"]
    # A lead byte followed by ASCII is invalid at once: shown with the ASCII.
    assert _stream(byte_tokenizer, [0xE4, ord("a")]) == ["", "\ufffda", ""]


def test_generated_bytes_completing_a_prompt_character_emit_it(byte_tokenizer):
    prompt = byte_tokenizer.encode("ab中", add_special_tokens=False)[:-1]  # cut mid-character
    assert _stream(byte_tokenizer, [0xAD, ord("c")], prompt) == ["中", "c", ""]


PROPERTY = settings(max_examples=60, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"),
                    max_size=40))
@example(text="a<|im_start|>b")
@pytest.mark.parametrize("name", TOKENIZERS)
def test_property_valid_text_never_shows_replacement_mid_stream(request, name, text):
    _assert_clean_stream(request.getfixturevalue(name), text)


@PROPERTY
@given(data=st.binary(max_size=40))
def test_property_random_bytes_stream_equals_lossy_decode(byte_tokenizer, data):
    pieces = _stream(byte_tokenizer, list(data))
    assert "".join(pieces) == byte_tokenizer.decode(list(data))
    assert not any(p.endswith("\ufffd") for p in pieces[:-1])
