"""Shared pieces of the engine tests: prompts around block boundaries, transformers'
own greedy output as the reference, and engines whose integrity is checked at teardown."""

from __future__ import annotations

import random

import pytest
import torch

from workers.engine import LLMEngine, SamplingParams

BLOCK_SIZE = 16
# Around block boundaries (1, bs-1, bs, bs+1, 2bs, ...) plus one long prompt.
PROMPT_LENS = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 100, 150, 200, 500, 511]
MAX_TOKENS = [9, 24, 5, 17, 16, 1, 12, 30, 7, 20, 15, 3, 25, 11, 18, 14, 6]
VOCAB = 259


def random_prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lens]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy decoding of one unpadded prompt (stops at EOS like we do)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             do_sample=False, max_new_tokens=max_tokens)
    return out[0, len(prompt):].tolist()


@pytest.fixture(name="make_engine")
def make_engine_fixture(tiny_model_dir):
    """Build engines on the tiny model (fp32, CPU); every one is integrity-checked at teardown."""
    engines: list[LLMEngine] = []

    def make(**kw) -> LLMEngine:
        kw.setdefault("num_kv_blocks", 512)
        kw.setdefault("device", "cpu")
        engine = LLMEngine(tiny_model_dir, block_size=kw.pop("block_size", BLOCK_SIZE), **kw)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.check_integrity()
