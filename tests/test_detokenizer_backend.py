"""`backend_decode`: the detokenizer's shortcut past transformers' decode wrapper gives
the wrapper's text exactly, and is not taken where the wrapper would change the text."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from workers.engine.detokenizer import backend_decode


@pytest.fixture(name="tokenizer", scope="module")
def tokenizer_fixture(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_matches_the_wrapper_on_every_token(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    vocab = len(tokenizer)
    windows = [[t] for t in range(vocab)] + [[rng.randrange(vocab) for _ in range(rng.randint(2, 9))]
                                             for _ in range(300)]
    decode = backend_decode(tokenizer, skip_special_tokens)
    for ids in windows:
        assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), ids


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_wrapper(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir, clean_up_tokenization_spaces=True)
    decode = backend_decode(tokenizer, True)
    calls = []
    tokenizer.decode = lambda ids, **kw: calls.append(ids) or "wrapped"  # the instance's own, seen by the fallback
    assert decode([72, 105]) == "wrapped" and calls == [[72, 105]]
