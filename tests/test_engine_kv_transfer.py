"""KV export from a prefill engine, import into a decode engine: the continuation is
exactly what one engine produces locally (greedy and seeded sampling alike)."""

from __future__ import annotations

import threading

import torch
import xxhash

from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine import SamplingParams


class CollectingSink:
    """A KVSink that keeps what it is handed, as a transport's sender queue would."""

    def __init__(self, start_block: int = 0) -> None:
        self.start_block = start_block
        self.layers: dict[int, torch.Tensor] = {}
        self.first_token_id: int | None = None
        self.first_logprob = None
        self.abort_reason: str | None = None
        self.events: list[str] = []
        self.checksums: dict[int, int | None] = {}

    def new_digest(self):
        return xxhash.xxh3_64()

    def export_buffer(self, nbytes: int) -> None:
        return None  # it keeps every layer: each needs memory of its own

    def on_layer(self, layer_idx: int, kv: torch.Tensor, checksum: int | None = None) -> None:
        assert layer_idx not in self.layers, "a layer was sent twice"
        self.layers[layer_idx] = kv
        self.checksums[layer_idx] = checksum
        self.events.append(f"layer{layer_idx}")

    def on_complete(self, first_token_id: int, logprob=None) -> None:
        self.first_token_id, self.first_logprob = first_token_id, logprob
        self.events.append("complete")

    def on_abort(self, reason: str) -> None:
        self.abort_reason = reason
        self.events.append("abort")


def prefill_remotely(prefill, prompt, params, seed, start_block=0) -> CollectingSink:
    sink = CollectingSink(start_block)
    prefill.add_request("p", prompt, SamplingParams(**{**params.__dict__, "max_tokens": 1}), kv_sink=sink, seed=seed)
    while prefill.has_unfinished_requests():
        prefill.step()
    return sink


def import_kv(decode, transfer_id, prompt, sink, reservation=None):
    reservation = reservation or decode.reserve_kv(transfer_id, prompt)
    for layer_idx, kv in sink.layers.items():
        decode.write_kv_layer(reservation, layer_idx, kv)
    return reservation


def reports(engine, request_id) -> list[tuple[list[int], str, str | None]]:
    """Every output `step()` reports for `request_id` until the engine is idle: (new ids, text, finish reason)."""
    got = []
    while engine.has_unfinished_requests():
        got += [(o.new_token_ids, o.text, o.finish_reason) for o in engine.step() if o.request_id == request_id]
    return got


def finish(engine, request_id):
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def check_transfer(make_engine, prompt, params, seed=1234):
    local = make_engine().generate([prompt], SamplingParams(**{**params.__dict__, "seed": seed}))[0].token_ids
    prefill, decode = make_engine(), make_engine()
    sink = prefill_remotely(prefill, prompt, params, seed)
    layout = prefill.layout
    assert sink.events == [f"layer{i}" for i in range(layout.num_layers)] + ["complete"]
    num_blocks = layout.num_blocks(len(prompt))  # includes the block with the last prompt token
    assert all(tuple(kv.shape) == layout.layer_shape(num_blocks) for kv in sink.layers.values())
    assert sink.first_token_id == local[0]
    # the checksum made during the export copy is the one of the bytes handed over
    assert all(sink.checksums[i] == xxhash.xxh3_64(kv.reshape(-1).view(torch.uint8).numpy()).intdigest()
               for i, kv in sink.layers.items())

    reservation = import_kv(decode, "t1", prompt, sink)
    assert reservation.layout == layout and reservation.num_cached_blocks == 0
    decode.commit_kv(reservation, "d", params, sink.first_token_id, seed=seed)
    assert finish(decode, "d").token_ids == local
    return local


def test_greedy_continuation_after_import_matches_local(make_engine):
    for n in (1, 16, 33):
        prompt = random_prompts([n], seed=n)[0]
        check_transfer(make_engine, prompt, greedy(12, ignore_eos=True))


def test_seeded_sampling_continues_identically_across_engines(make_engine):
    prompt = random_prompts([40], seed=7)[0]
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=50, ignore_eos=True)
    assert len(set(check_transfer(make_engine, prompt, params))) > 3


def test_import_reuses_decode_prefix_cache_and_skips_cached_blocks(make_engine):
    prompt = random_prompts([70], seed=3)[0]
    params = greedy(10, ignore_eos=True)
    local = make_engine().generate([prompt], params)[0].token_ids
    prefill, decode = make_engine(), make_engine()
    decode.generate([prompt[:40] + [1, 2, 3]], greedy(1))  # caches 2 blocks of the prefix

    reservation = decode.reserve_kv("t", prompt)
    assert reservation.num_cached_blocks == 2 and reservation.num_blocks_to_receive == 3
    sink = prefill_remotely(prefill, prompt, params, seed=0, start_block=reservation.num_cached_blocks)
    assert all(kv.shape[1] == 3 for kv in sink.layers.values())
    import_kv(decode, "t", prompt, sink, reservation)
    decode.commit_kv(reservation, "d", params, sink.first_token_id)
    assert finish(decode, "d").token_ids == local


def test_layers_written_from_another_thread_while_the_engine_steps(make_engine):
    prompt = random_prompts([50], seed=5)[0]
    params = greedy(8, ignore_eos=True)
    local = make_engine().generate([prompt], params)[0].token_ids
    prefill, decode = make_engine(), make_engine()
    sink = prefill_remotely(prefill, prompt, params, seed=0)
    reservation = decode.reserve_kv("t", prompt)
    decode.add_request("busy", random_prompts([64], seed=9)[0], greedy(30, ignore_eos=True))
    writer = threading.Thread(target=import_kv, args=(decode, "t", prompt, sink, reservation))
    writer.start()
    while writer.is_alive():
        decode.step()
    writer.join()
    decode.commit_kv(reservation, "d", params, sink.first_token_id)
    assert finish(decode, "d").token_ids == local


def test_cancel_frees_the_reservation_and_a_full_pool_refuses(make_engine):
    decode = make_engine(num_kv_blocks=8)
    prompt = random_prompts([100], seed=4)[0]  # 7 blocks
    reservation = decode.reserve_kv("a", prompt)
    assert decode.stats()["kv_blocks_free"] == 1
    assert decode.reserve_kv("b", prompt) is None
    decode.check_integrity()
    decode.cancel_kv(reservation)
    decode.cancel_kv(reservation)
    assert decode.stats()["kv_blocks_free"] == 8


def test_abort_before_the_prompt_completes_tells_the_sink(make_engine):
    prefill = make_engine(max_num_batched_tokens=16)
    sink = CollectingSink()
    prefill.add_request("p", random_prompts([64], seed=6)[0], greedy(1), kv_sink=sink)
    prefill.step()  # one chunk of four
    assert prefill.abort_request("p")
    assert sink.events == ["abort"] and sink.abort_reason == "abort"
    assert prefill.stats()["kv_blocks_free"] == prefill.stats()["kv_blocks_total"]
    assert [o.finish_reason for o in prefill.step()] == ["abort"]
    assert not prefill.has_unfinished_requests()


def test_bfloat16_kv_arrives_bit_identical_and_decodes_like_local(make_engine):
    prompt = random_prompts([45], seed=8)[0]
    params = greedy(8, ignore_eos=True)
    local = make_engine(dtype="bfloat16").generate([prompt], params)[0].token_ids
    prefill, decode = make_engine(dtype="bfloat16"), make_engine(dtype="bfloat16")
    assert prefill.layout.dtype == "bfloat16" and prefill.layout.fingerprint() == decode.layout.fingerprint()
    sink = prefill_remotely(prefill, prompt, params, seed=0)
    reservation = import_kv(decode, "t", prompt, sink)
    cache = decode.runner.kv_cache
    for layer_idx, kv in sink.layers.items():
        assert kv.dtype == torch.bfloat16
        assert torch.equal(cache.read_blocks(layer_idx, reservation.block_ids), kv)
    decode.commit_kv(reservation, "d", params, sink.first_token_id)
    assert finish(decode, "d").token_ids == local


def test_decode_really_reads_the_imported_kv(make_engine):
    """Control for the tests above: import a wrong layer and the continuation changes."""
    prompt = random_prompts([30], seed=12)[0]
    params = greedy(10, ignore_eos=True)
    local = make_engine().generate([prompt], params)[0].token_ids
    sink = prefill_remotely(make_engine(), prompt, params, seed=0)
    sink.layers[0] = sink.layers[0].flip(2)  # tokens' KV in reversed order within each block
    decode = make_engine()
    reservation = import_kv(decode, "t", prompt, sink)
    decode.commit_kv(reservation, "d", params, sink.first_token_id)
    assert finish(decode, "d").token_ids != local


def test_refused_commit_frees_its_reservation(make_engine):
    """A commit the engine refuses (here: prompt + max_tokens over the context) must not
    strand the reserved blocks."""
    prefill, decode = make_engine(), make_engine()
    prompt = random_prompts([40], seed=3)[0]
    sink = prefill_remotely(prefill, prompt, greedy(4), seed=1)
    reservation = import_kv(decode, "t-refused", prompt, sink)
    free_before = decode.stats()["kv_blocks_free"]
    too_long = greedy(decode.runner.max_model_len)
    try:
        decode.commit_kv(reservation, "r", too_long, sink.first_token_id)
    except ValueError as e:
        assert "exceeds" in str(e)
    else:
        raise AssertionError("commit of an over-long request was accepted")
    assert decode.stats()["kv_blocks_free"] > free_before
    assert decode.stats()["kv_blocks_free"] == decode.stats()["kv_blocks_total"]


def test_first_output_after_import_is_the_first_token_with_its_text_once(make_engine):
    """`commit_kv` reports the prefill replica's token as the request's first output, with
    its text from the request's own detokenizer and stop rules: every output (ids, text,
    finish reason) is the one the local route reports, also when a stop string or
    max_tokens=1 ends the request on that token, or the first token's text is held back
    as the possible start of a stop string."""
    local, prefill, decode = make_engine(), make_engine(), make_engine()
    for seed in (0, 1, 2):  # first tokens whose text shows at once (seed 2's with the prompt's broken tail)
        prompt = random_prompts([40], seed=seed)[0]
        local.add_request("probe", prompt, greedy(1))
        (_, first_text, _), = reports(local, "probe")
        assert first_text
        stop = first_text[-1]
        for i, params in enumerate((greedy(8, ignore_eos=True), greedy(1), greedy(8, stop=(stop,)),
                                    greedy(1, stop=(stop,)), greedy(8, stop=(stop + "\u2603",)))):
            local.add_request("l", prompt, params, seed=0)
            want = reports(local, "l")
            transfer_id = f"t{seed}.{i}"
            reservation = decode.reserve_kv(transfer_id, prompt)
            sink = prefill_remotely(prefill, prompt, params, seed=0, start_block=reservation.num_cached_blocks)
            import_kv(decode, transfer_id, prompt, sink, reservation)
            decode.commit_kv(reservation, "d", params, sink.first_token_id, seed=0)
            got = reports(decode, "d")
            assert got == want, (seed, params)
            assert got[0][0] == [sink.first_token_id]


def test_an_imported_request_decodes_ahead_of_waiting_prompts(make_engine):
    """Imported KV holds every prompt token: its next token is a decode token, which is
    scheduled before prompt chunks, not behind the prompts that were waiting first. Its
    output is the local one all the same."""
    prompt, params = list(range(3, 40)), SamplingParams(max_tokens=4, temperature=0.0)
    local = make_engine().generate([prompt], params)[0].token_ids
    prefill, decode = make_engine(), make_engine(max_num_batched_tokens=64)
    sink = prefill_remotely(prefill, prompt, params, 0)
    for i in range(3):  # long prompts queue first: each needs several 64-token chunks
        decode.add_request(f"long{i}", [5 + i] * 300, SamplingParams(max_tokens=2, temperature=0.0))
    decode.step()
    decode.commit_kv(import_kv(decode, "t", prompt, sink), "d", params, sink.first_token_id)
    steps_to_finish, final = 0, None
    while final is None:
        steps_to_finish += 1
        final = next((o for o in decode.step() if o.request_id == "d" and o.finished), None)
    assert final.token_ids == local
    assert steps_to_finish <= len(local) + 1  # one step per token, not after ~14 prompt chunks
    finish(decode, "long2")
