"""The sampler: greedy is argmax, randomness is a pure function of (seed, position), and
top-k / top-p / min_tokens restrict what can be drawn. Fixed seeds: nothing can flake."""

from __future__ import annotations

import torch

from workers.engine.sampler import Sampler, SamplingRow, apply_top_k_top_p, request_seed
from workers.engine.sampling_params import SamplingParams

VOCAB = 64
EOS = frozenset({3})


def _row(params: SamplingParams, seed: int = 0, output_index: int = 0, eos=EOS) -> SamplingRow:
    return SamplingRow(params=params, seed=seed, output_index=output_index, eos_token_ids=eos)


def _logits(num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(num_rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_for_every_row():
    logits = _logits(8)
    rows = [_row(SamplingParams(temperature=0.0), seed=i) for i in range(8)]
    assert Sampler()(logits, rows) == logits.argmax(dim=-1).tolist()


def test_mixed_batch_greedy_rows_unaffected_by_random_rows():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)] * 3
    out = Sampler()(logits, [_row(p, seed=i) for i, p in enumerate(params)])
    for i in range(0, 6, 2):
        assert out[i] == logits[i].argmax().item()


def _generate(sampler_for_index, logits_seq, params, seed):
    return [
        sampler_for_index(i)(logits[None], [_row(params, seed=seed, output_index=i)])[0]
        for i, logits in enumerate(logits_seq)
    ]


def test_same_seed_reproduces_and_split_between_workers_changes_nothing():
    logits_seq = _logits(32, seed=1)
    params = SamplingParams(temperature=1.0, seed=1234)
    one = Sampler()
    local = _generate(lambda i: one, logits_seq, params, seed=1234)
    prefill, decode = Sampler(), Sampler()
    split = _generate(lambda i: prefill if i == 0 else decode, logits_seq, params, seed=1234)
    again = _generate(lambda i: Sampler(), logits_seq, params, seed=1234)
    assert local == split == again
    other = _generate(lambda i: one, logits_seq, params, seed=4321)
    assert other != local  # 32 draws at temperature 1 over 64 tokens


def test_token_does_not_depend_on_batch_position_or_neighbours():
    logits = _logits(4, seed=2)
    params = SamplingParams(temperature=0.8)
    rows = [_row(params, seed=10 + i, output_index=5) for i in range(4)]
    batched = Sampler()(logits, rows)
    alone = [Sampler()(logits[i:i + 1], [rows[i]])[0] for i in range(4)]
    reversed_ = Sampler()(logits.flip(0), rows[::-1])[::-1]
    assert batched == alone == reversed_


def _draws(logits_row: torch.Tensor, params: SamplingParams, num_draws: int) -> list[int]:
    rows = [_row(params, seed=7, output_index=i) for i in range(num_draws)]
    return Sampler()(logits_row.expand(num_draws, -1), rows)


def test_top_k_restricts_support_to_k_most_likely():
    logits = _logits(1, seed=3)[0]
    allowed = set(logits.topk(5).indices.tolist())
    draws = _draws(logits * 0.1, SamplingParams(top_k=5), 2000)  # flattened: all 5 get hit
    assert set(draws) == allowed


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * (VOCAB - 4)))
    assert set(_draws(logits, SamplingParams(top_p=0.7), 2000)) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_p=0.79), 2000)) == {0, 1}
    assert set(_draws(logits, SamplingParams(top_p=0.81), 2000)) == {0, 1, 2}
    assert set(_draws(logits, SamplingParams(top_p=0.01), 200)) == {0}


def test_top_p_one_keeps_everything_even_tiny_tail():
    logits = torch.zeros(1, VOCAB)
    out = apply_top_k_top_p(logits, [0], [1.0])
    assert torch.equal(out, logits)


def test_sample_frequencies_follow_temperature_scaled_softmax():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.1] + [0.0] * (VOCAB - 3)))
    draws = torch.tensor(_draws(logits, SamplingParams(temperature=1.0), 4000))
    freq = torch.bincount(draws, minlength=3)[:3].float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.6, 0.3, 0.1]), atol=0.03), freq
    cold = torch.tensor(_draws(logits, SamplingParams(temperature=0.25), 4000))
    expected = torch.tensor([0.6, 0.3, 0.1]) ** 4
    expected /= expected.sum()
    freq = torch.bincount(cold, minlength=3)[:3].float() / len(cold)
    assert torch.allclose(freq, expected, atol=0.03), freq


def test_min_tokens_masks_eos_and_stop_token_ids_then_releases_them():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 100.0  # EOS
    logits[0, 9] = 90.0  # a stop token id
    logits[0, 20] = 50.0
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, min_tokens=2, max_tokens=4,
                                stop_token_ids=[9])
        draws = [Sampler()(logits, [_row(params, output_index=i)])[0] for i in range(3)]
        assert draws == [20, 20, 3]


def test_ignore_eos_keeps_eos_sampleable():
    logits = torch.zeros(1, VOCAB)
    logits[0, 3] = 100.0
    params = SamplingParams(temperature=0.0, ignore_eos=True)
    assert Sampler()(logits, [_row(params)]) == [3]


def test_request_seed_uses_given_seed_or_draws_one():
    assert request_seed(SamplingParams(seed=5)) == 5
    assert request_seed(SamplingParams()) != request_seed(SamplingParams())


def test_top_k_shortcut_matches_full_sort():
    logits = _logits(4, seed=5)
    top_k, top_p = [3, 10, 1, 7], [0.5, 1.0, 0.9, 0.95]
    fast = apply_top_k_top_p(logits, top_k, top_p)
    with_full_sort = apply_top_k_top_p(logits, [*top_k[:3], 0], [*top_p[:3], 1.0])
    assert torch.equal(fast[:3], with_full_sort[:3])
    assert (fast[3] > float("-inf")).sum() <= 7
    kept = fast[1] > float("-inf")
    assert set(kept.nonzero().flatten().tolist()) == set(logits[1].topk(10).indices.tolist())
