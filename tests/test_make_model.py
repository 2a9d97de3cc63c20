import filecmp

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from workers.model_files import make_model


def test_same_seed_same_bytes(tmp_path):
    a = make_model(tmp_path / "a", "tiny", 7)
    b = make_model(tmp_path / "b", "tiny", 7)
    names = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert sorted(match) == sorted(names), (mismatch, errors)


def test_loads_through_from_pretrained(tiny_model_dir):
    config = AutoConfig.from_pretrained(tiny_model_dir)
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert model.config.vocab_size == config.vocab_size


def test_tokenizer_round_trips_any_text_and_has_chat_template(tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = "héllo wörld 🙂 \n\t <tag>"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"
