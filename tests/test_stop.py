"""Finish decisions and what text a stream may show: EOS, stop ids, stop strings across
token boundaries (cut, never partly shown), max_tokens, min_tokens."""

from __future__ import annotations

from workers.engine.sampling_params import SamplingParams
from workers.engine.stop import StopChecker

EOS = frozenset({0})


def _run(params: SamplingParams, pieces: list[tuple[int, str]]):
    """Feed (token_id, text) pairs until finished; return (reason, stop_reason, text, n)."""
    checker = StopChecker(params, EOS)
    shown = ""
    for n, (token_id, text) in enumerate(pieces, 1):
        decision = checker.append(token_id, text)
        shown += decision.text
        if decision.finish_reason:
            return decision.finish_reason, decision.stop_reason, shown, n
    return None, None, shown, len(pieces)


def _chars(text: str, start_id: int = 100) -> list[tuple[int, str]]:
    return [(start_id + i, ch) for i, ch in enumerate(text)]


def test_eos_stops_unless_ignore_eos():
    pieces = _chars("ab") + [(0, "")] + _chars("cd")
    assert _run(SamplingParams(max_tokens=10), pieces) == ("stop", None, "ab", 3)
    assert _run(SamplingParams(max_tokens=5, ignore_eos=True), pieces) == ("length", None, "abcd", 5)


def test_stop_token_id_stops_and_reports_itself():
    pieces = _chars("abc") + [(7, "x")] + _chars("y")
    assert _run(SamplingParams(max_tokens=10, stop_token_ids=[7]), pieces) == ("stop", 7, "abcx", 4)


def test_max_tokens_gives_length_and_releases_held_text():
    pieces = _chars("hello wo")
    assert _run(SamplingParams(max_tokens=8, stop=["world"]), pieces) == (
        "length", None, "hello wo", 8)


def test_stop_string_across_tokens_is_cut_and_never_partly_shown():
    pieces = [(1, "Hel"), (2, "lo, "), (3, "wor"), (4, "ld!"), (5, " more")]
    checker = StopChecker(SamplingParams(max_tokens=10, stop=["world"]), EOS)
    shown = [checker.append(t, s).text for t, s in pieces[:3]]
    assert shown == ["Hel", "lo, ", ""]  # "wor" might begin "world": held back
    decision = checker.append(*pieces[3])
    assert (decision.finish_reason, decision.stop_reason, decision.text) == ("stop", "world", "")
    assert checker.text == "Hello, "
    assert checker.num_tokens == 4  # the token that completed the stop is an output token


def test_held_back_text_is_released_once_it_diverges():
    checker = StopChecker(SamplingParams(max_tokens=10, stop=["STOP"]), EOS)
    assert checker.append(1, "aS").text == "a"
    assert checker.append(2, "T").text == ""
    assert checker.append(3, "x").text == "STx"


def test_first_completed_stop_string_wins_and_text_after_is_dropped():
    params = SamplingParams(max_tokens=10, stop=["cd", "bcdef", "x"])
    assert _run(params, [(1, "ab"), (2, "cdefx")]) == ("stop", "cd", "ab", 2)


def test_stop_string_inside_one_token():
    assert _run(SamplingParams(stop=["\n\n"]), [(1, "a"), (2, "b\n\nc")]) == ("stop", "\n\n", "ab", 2)


def test_min_tokens_defers_every_stop():
    params = SamplingParams(max_tokens=10, min_tokens=4, stop=["b"], stop_token_ids=[7])
    pieces = [(0, ""), (7, "x"), (1, "b"), (2, "c"), (3, "b")]
    # EOS, the stop id and a stop string all come before min_tokens: ignored; a match
    # that completed then is not found again later.
    assert _run(params, pieces) == ("stop", "b", "xbc", 5)


def test_min_tokens_then_eos_stops():
    params = SamplingParams(max_tokens=10, min_tokens=2)
    assert _run(params, [(0, ""), (0, ""), (5, "z")]) == ("stop", None, "", 2)


def test_release_gives_detokenizer_tail_unless_stop_string():
    checker = StopChecker(SamplingParams(max_tokens=1), EOS)
    assert checker.append(1, "").finish_reason == "length"
    assert checker.release("\ufffd") == "\ufffd"
    checker = StopChecker(SamplingParams(max_tokens=3, stop=["a"]), EOS)
    assert checker.append(1, "a").stop_reason == "a"
    assert checker.release("zz") == ""


def test_streamed_text_is_always_a_prefix_of_the_final_text():
    text = "the quick stop-brown fox stops; stop here STOP"
    for stop in (["stop here"], ["STOP", "fox s"], ["q", "quick"], ["nothing"]):
        pieces = [(10 + i, text[i:i + 3]) for i in range(0, len(text), 3)]
        checker = StopChecker(SamplingParams(max_tokens=100, stop=stop), EOS)
        shown = ""
        for token_id, piece in pieces:
            d = checker.append(token_id, piece)
            shown += d.text
            assert checker.text.startswith(shown)
            if d.finish_reason:
                break
        expected = min((text.find(s) for s in stop if s in text), default=len(text))
        assert shown == text[:expected]
