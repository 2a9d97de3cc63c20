"""`pdcluster bench router-overhead` without Ray: the command is registered, its
medians, the HTTP request it times asks for an event per token, and the client process
that times it."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
from typer.testing import CliRunner

from cluster.bench.router_overhead import HttpClientProcess, http_ttft_s
from cluster.bench.router_overhead_cli import _medians
from cluster.cli import app


def test_command_is_registered():
    result = CliRunner().invoke(app, ["bench", "router-overhead", "--help"])
    assert result.exit_code == 0
    assert "--echo" in result.output and "--serve-env" in result.output


def test_medians_skip_missing_figures():
    runs = [{"num_samples": 30, "router_ttft_p50_ms": 80.0, "router_side_ttft_mean_ms": None},
            {"num_samples": 30, "router_ttft_p50_ms": 90.0, "router_side_ttft_mean_ms": 70.0},
            {"num_samples": 30, "router_ttft_p50_ms": 70.0, "router_side_ttft_mean_ms": 72.0}]
    assert _medians(runs) == {"router_ttft_p50_ms": 80.0, "router_side_ttft_mean_ms": 71.0}


def test_summary_reports_every_path_against_the_router():
    from cluster.bench.router_overhead import _summary

    times = {"router": [0.020, 0.022, 0.030], "direct": [0.015, 0.019, 0.016], "stream": [0.012, 0.013, 0.020]}
    out = _summary(times, 3, 64, 2, None)
    assert out["router_overhead_ttft_p50_ms"] == 6.0  # 22 - 16
    assert out["router_overhead_vs_stream_p50_ms"] == 9.0  # 22 - 13
    assert out["router_overhead_paired_p50_ms"] == 5.0  # median of 5, 3, 14
    assert out["router_overhead_vs_stream_paired_p50_ms"] == 9.0  # median of 8, 9, 10
    without = _summary({k: v for k, v in times.items() if k != "stream"}, 3, 64, 2, None)
    assert "router_overhead_vs_stream_p50_ms" not in without


def test_http_path_times_the_first_token_event():
    """A first chunk without text (an incomplete UTF-8 byte) still carries its token id."""
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["body"] = request.read()
        events = ('data: {"choices":[{"text":"","token_ids":[195]}]}\n\n'
                  'data: {"choices":[{"text":"\u00e9","token_ids":[169]}]}\n\ndata: [DONE]\n\n')
        return httpx.Response(200, text=events, headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as http:
        assert http_ttft_s(http, "http://router", [65] * 4, 2) > 0
    assert json.loads(seen["body"])["return_token_ids"] is True


class _SSEHandler(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        self.rfile.read(int(self.headers["content-length"]))
        if self.path.startswith("/broken"):
            self.send_error(500)
            return
        body = b'data: {"choices":[{"text":"a","token_ids":[97]}]}\n\ndata: [DONE]\n\n'
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_http_client_process_times_real_requests_and_reports_failures():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SSEHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with HttpClientProcess(base) as client:
            assert all(0 < client.ttft_s([65] * 4, 2) < 10 for _ in range(3))
        with HttpClientProcess(f"{base}/broken") as client, pytest.raises(RuntimeError, match="500"):
            client.ttft_s([65] * 4, 2)
    finally:
        server.shutdown()


def test_first_token_clock_times_the_first_content_chunk_and_reports_errors():
    from cluster.bench.router_overhead import FirstToken
    from workers.protocol import GenerateChunk

    clock = FirstToken("stream")
    clock.see(GenerateChunk())  # no content yet (a route-only chunk)
    assert clock.ttft is None
    clock.see(GenerateChunk(token_ids=[5]))
    first = clock.ttft_s()
    clock.see(GenerateChunk(token_ids=[6]))
    assert clock.ttft_s() == first > 0
    with pytest.raises(RuntimeError, match="stream"):
        FirstToken("stream").ttft_s()
    with pytest.raises(RuntimeError, match="decode replica error"):
        FirstToken("handle").see(GenerateChunk(finished=True, finish_reason="error", error={"message": "x"}))
