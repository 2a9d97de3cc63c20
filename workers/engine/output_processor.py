"""Per-request token-to-text bookkeeping: incremental text and the finish decision.

Wraps the incremental detokenizer and the StopChecker so the engine asks one question
per generated token: "is this request finished, and what text may be shown now?"
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workers.engine.detokenizer import IncrementalDetokenizer
from workers.engine.sampling_params import SamplingParams
from workers.engine.stop import StopChecker

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: frozenset[int], detokenize: bool) -> None:
        # Text is only needed for streams and stop strings; token-only callers skip it.
        self.detokenizer = (IncrementalDetokenizer(tokenizer, prompt_token_ids)
                            if detokenize or params.stop else None)
        self.stop_checker = StopChecker(params, eos_token_ids)

    def append(self, token_id: int) -> tuple[str | None, str]:
        """Feed one generated token; returns (finish_reason or None, new text to show)."""
        new_text = self.detokenizer.push(token_id) if self.detokenizer else ""
        decision = self.stop_checker.append(token_id, new_text)
        text = decision.text
        if decision.finish_reason is not None and self.detokenizer is not None:
            text += self.stop_checker.release(self.detokenizer.flush())
        return decision.finish_reason, text
