"""lm-eval-harness's `local-completions` model against a served endpoint, on a small
multiple-choice task written here (no download), and the same loglikelihoods computed
by transformers itself, so a test can hold the two against each other."""

from __future__ import annotations

import json
from pathlib import Path

TASK = "pdc_multiple_choice"
DOCS = [
    {"question": "The sky on a clear day is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" four", " seven", " a fish"], "answer": 0},
    {"question": "Ice is made of frozen", "choices": [" water", " sand"], "answer": 0},
    {"question": "Une phrase en français: le café est", "choices": [" chaud", " très froid"], "answer": 0},
]


def write_task(folder: Path) -> Path:
    """A multiple-choice task over a local JSONL file, in lm-eval's YAML task format."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "target_delimiter: \"\"\n"
        "doc_to_text: \"{{question}}\"\n"
        "doc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\n"
        "metric_list:\n  - metric: acc\n")
    return folder


def served_loglikelihoods(base_url: str, model: str, model_dir: Path, task_dir: Path,
                          headers: dict[str, str] | None = None) -> list[list[float]]:
    """Per document, the loglikelihood of each choice as lm-eval's `local-completions`
    model reads it from `/v1/completions` (echo + logprobs over token-id prompts)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"model": model, "base_url": f"{base_url}/v1/completions", "tokenizer": str(model_dir),
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1,
                    "header": {"Authorization": "Bearer unused", **(headers or {})}},
        tasks=[TASK], task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
        batch_size=1)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [[resp[0][0] for resp in s["resps"]] for s in samples]


def reference_loglikelihoods(model_dir: Path) -> list[list[float]]:
    """The same quantities from transformers: sum of log-softmax over the continuation's
    tokens given the context, tokenized as lm-eval does (context and continuation apart)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    result = []
    for doc in DOCS:
        context = tokenizer(doc["question"], add_special_tokens=False)["input_ids"]
        row = []
        for choice in doc["choices"]:
            continuation = tokenizer(choice, add_special_tokens=False)["input_ids"]
            ids = torch.tensor([context + continuation])
            with torch.no_grad():
                logprobs = model(ids).logits[0].float().log_softmax(-1)
            positions = range(len(context) - 1, len(context) + len(continuation) - 1)
            row.append(sum(logprobs[p, ids[0, p + 1]].item() for p in positions))
        result.append(row)
    return result
