"""A small OpenAI-compatible server with known timing, for testing the load tester.

Real HTTP on real sockets (uvicorn + starlette, bound to 127.0.0.1, port 0), run in its own
process so its event loop never shares a GIL with the client under test. Every answer has
exactly `max_tokens` tokens (one byte each); the first arrives `ttft_ms` after the request
and each next one `tpot_ms` after the previous, on a fixed grid from the arrival time so
delays never accumulate. Chat streams open with a role-only chunk sent at once (which a
correct client must not count as the first token); the last chunk carries `usage`.

    python -m tests.fake_openai_server --ttft-ms 50 --tpot-ms 10   # prints "READY <port>"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass
class FakeTiming:
    ttft_ms: float = 50.0
    tpot_ms: float = 10.0
    tokens_per_chunk: int = 1
    disagg_min_prompt: int = 256  # x-pd-route: disagg at or above this prompt length
    error_every: int = 0  # every Nth request: HTTP 500 before streaming
    stream_error_every: int = 0  # every Nth request: an SSE error event after 2 chunks
    reject_token_ids: bool = False  # 400 for a token-id prompt, like plain OpenAI servers
    reject_extensions: bool = False  # 400 for ignore_eos / min_tokens
    predicted_scale: float = 0.0  # x-pd-predicted-{ttft,tpot}-ms: this × the true ttft_ms, tpot_ms; 0: none


def _prompt_len(body: dict) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).encode()) for m in body["messages"])
    prompt = body.get("prompt", "")
    return len(prompt) if isinstance(prompt, list) else len(str(prompt).encode())


def _error(status: int, message: str, kind: str = "invalid_request_error"):
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def build_app(timing: FakeTiming):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    state = {"count": 0, "in_flight": 0, "max_in_flight": 0, "arrivals": [], "finished": 0, "loop_lags": []}
    watcher: list[asyncio.Task] = []

    async def watch_loop_lag() -> None:  # how late timers fire: this process's CPU starvation
        while True:
            due = time.perf_counter() + 0.01
            await asyncio.sleep(0.01)
            state["loop_lags"].append(max(0.0, time.perf_counter() - due))

    def chunk(body: dict, chat: bool, text: str | None, usage: dict | None = None, role: bool = False) -> str:
        if chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": None}]
            obj = "chat.completion.chunk"
        else:
            choices = [] if usage else [{"index": 0, "text": text, "finish_reason": None}]
            obj = "text_completion"
        payload = {"id": "fake", "object": obj, "model": body.get("model", "fake-model"), "choices": choices}
        if usage:
            payload["usage"] = usage
        return f"data: {json.dumps(payload)}\n\n"

    async def generate(request: Request, chat: bool):
        arrived = time.perf_counter()
        if not watcher:
            watcher.append(asyncio.create_task(watch_loop_lag()))
        body = await request.json()
        state["count"] += 1
        number = state["count"]
        state["arrivals"].append(arrived)
        if timing.reject_token_ids and isinstance(body.get("prompt"), list):
            return _error(400, "prompt must be a string")
        if timing.reject_extensions and ({"ignore_eos", "min_tokens"} & body.keys()):
            return _error(400, "unrecognized request argument: ignore_eos")
        if timing.error_every and number % timing.error_every == 0:
            return _error(500, "injected failure", "server_error")
        n = int(body.get("max_tokens") or 16)
        prompt_len = _prompt_len(body)
        usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
        mode = request.headers.get("x-pd-mode", "auto")
        route = mode if mode in ("local", "disagg") else ("disagg" if prompt_len >= timing.disagg_min_prompt else "local")
        headers = {"x-pd-route": route, "x-pd-reason": "forced" if mode != "auto" else "short-prompt",
                   "x-request-id": request.headers.get("x-request-id", f"fake-{number}")}
        if timing.predicted_scale:  # only on answers that succeed, as the router sends them
            headers["x-pd-predicted-ttft-ms"] = f"{timing.predicted_scale * timing.ttft_ms:.3f}"
            headers["x-pd-predicted-tpot-ms"] = f"{timing.predicted_scale * timing.tpot_ms:.3f}"
        fail_mid_stream = timing.stream_error_every and number % timing.stream_error_every == 0

        async def until(k: int) -> None:  # token k (0-based) is due at ttft + k * tpot
            due = arrived + (timing.ttft_ms + k * timing.tpot_ms) / 1000.0
            await asyncio.sleep(max(0.0, due - time.perf_counter()))

        async def events():
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            try:
                if chat:
                    yield chunk(body, chat, None, role=True)
                sent = 0
                while sent < n:
                    take = min(timing.tokens_per_chunk, n - sent)
                    await until(sent + take - 1)
                    if fail_mid_stream and sent >= 2:
                        yield f"data: {json.dumps({'error': {'message': 'injected mid-stream failure', 'type': 'server_error'}})}\n\n"
                        yield "data: [DONE]\n\n"
                        return
                    yield chunk(body, chat, "a" * take)
                    sent += take
                if (body.get("stream_options") or {}).get("include_usage"):
                    yield chunk(body, chat, None, usage=usage)
                yield "data: [DONE]\n\n"
            finally:
                state["in_flight"] -= 1
                state["finished"] += 1

        if body.get("stream"):
            return StreamingResponse(events(), media_type="text/event-stream", headers=headers)
        await until(n - 1)
        state["finished"] += 1
        text = "a" * n
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        return JSONResponse({"id": "fake", "object": "chat.completion" if chat else "text_completion",
                             "choices": [choice], "usage": usage}, headers=headers)

    async def completions(request: Request):
        return await generate(request, chat=False)

    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def stats(request: Request):
        lags = sorted(state["loop_lags"]) or [0.0]
        lag_ms = {f"p{q}": 1000 * lags[min(len(lags) - 1, int(q / 100 * len(lags)))] for q in (50, 90, 99)}
        return JSONResponse({**{k: v for k, v in state.items() if k != "loop_lags"}, "loop_lag_ms": lag_ms})

    async def reset(request: Request):
        state.update(count=0, in_flight=0, max_in_flight=0, arrivals=[], finished=0, loop_lags=[])
        return JSONResponse({"ok": True})

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models), Route("/stats", stats), Route("/reset", reset, methods=["POST"]),
    ])


def serve(timing: FakeTiming, port: int = 0) -> None:
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(2048)  # before READY: connections queue until uvicorn accepts them
    config = uvicorn.Config(build_app(timing), log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=30, backlog=2048)
    server = uvicorn.Server(config)
    print(f"READY {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])


class FakeServer:
    """Context manager: the fake server in a child process; `.url` while inside."""

    def __init__(self, **timing) -> None:
        self.timing = FakeTiming(**timing)
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> FakeServer:
        args = [sys.executable, "-m", "tests.fake_openai_server"]
        for f in fields(FakeTiming):
            value = getattr(self.timing, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                args += [flag] if value else []
            else:
                args += [flag, str(value)]
        root = Path(__file__).resolve().parent.parent
        self.proc = subprocess.Popen(args, cwd=root, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("READY"):
            self.proc.kill()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}"
        return self

    def stats(self) -> dict:
        import httpx

        return httpx.get(self.url + "/stats", timeout=10).json()

    def reset(self) -> None:
        import httpx

        httpx.post(self.url + "/reset", timeout=10)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    for f in fields(FakeTiming):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true")
        else:
            parser.add_argument(flag, type=float if f.type in ("float", float) else int, default=f.default)
    args = vars(parser.parse_args())
    port = args.pop("port")
    serve(FakeTiming(**args), port)


if __name__ == "__main__":
    main()
