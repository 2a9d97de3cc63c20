"""Model folders: the embedded presets (`pdcluster make-model`), and the folder a config
names, found or made once per machine.

Nothing can be downloaded at run time, so tests, demos and benchmarks run on a
Llama-architecture model whose weights come from a seed. It is written with
`save_pretrained` and read back through the ordinary `from_pretrained` path, so a
real Llama / Qwen2 / Mistral folder loads exactly the same way.

The tokenizer is byte-level (every UTF-8 byte is one token, no merges) plus ChatML
special tokens, so any text round-trips and prompt lengths in tokens are exact.
"""

from __future__ import annotations

import fcntl
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.config import ConfigError

if TYPE_CHECKING:
    from cluster.config import ModelConfig

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NUM_BYTE_TOKENS = 256


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    # Random weights drawn at the usual 0.02 give near-uniform logits, where greedy
    # argmax flips on float noise; a wider draw gives clear winners, so token-exact
    # comparisons test the engine rather than rounding.
    initializer_range: float


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 128, 2, 4, 2, 4096, 0.2),
    "small": Preset(512, 1408, 8, 8, 2, 4096, 0.08),
}


def vocab_size() -> int:
    """Byte tokens plus specials, unpadded: every id the model can emit decodes."""
    return NUM_BYTE_TOKENS + len(SPECIAL_TOKENS)


def build_tokenizer():
    """A byte-level BPE tokenizer without merges: one token per UTF-8 byte."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=PRESETS["tiny"].max_position_embeddings,
    )


def _byte_of(ch: str) -> int:
    """The byte that a ByteLevel alphabet character stands for (GPT-2's mapping)."""
    return _unicode_to_byte()[ch]


@functools.cache
def _unicode_to_byte() -> dict[str, int]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


def make_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a model folder; the same preset and seed give the same bytes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.model_max_length = p.max_position_embeddings
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = LlamaConfig(
        vocab_size=vocab_size(),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=p.max_position_embeddings,
        initializer_range=p.initializer_range,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    _write_marker(out, preset, seed)
    return out


def _write_marker(out: Path, preset: str, seed: int) -> None:
    (out / "pdcluster_model.json").write_text(json.dumps({"preset": preset, "seed": seed}) + "\n")


def ensure_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Make the model once; reuse it when the folder already holds the same preset."""
    out = Path(out_dir)
    marker = out / "pdcluster_model.json"
    if marker.exists() and json.loads(marker.read_text()) == {"preset": preset, "seed": seed}:
        return out
    return make_model(out, preset, seed)


def resolve_model_path(model: ModelConfig) -> Path:
    """The folder `model` names: `model.path`, checked, or its preset made under
    `model.cache_dir` on first use. A preset is made once per machine under a file lock,
    since several replicas on one node start at the same time."""
    if model.path:
        path = Path(model.path)
        if not (path / "config.json").exists():
            raise ConfigError(f"config error at model.path: no model folder at {path}")
        return path
    cache = Path(model.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".make-model.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return ensure_model(cache / f"{model.preset}-seed{model.seed}", model.preset, model.seed)
