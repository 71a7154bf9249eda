"""`python -m jaxspec.bench --serve-load FILE.jsonl`: a load test of the server (`python -m jaxspec.serve`).

Why: a server's users see requests per second, the time to their first token and their own tokens per second under
concurrency, not the batch CLI's tokens per second; and speculation that pays for one request can cost at sixteen
(every slot's verify competes for the same weight reads). What: the server is started in this process (uvicorn on
a loopback port, the engine thread beside it), once with the draft and once target-only, each warmed up (each level
run once, so that the prefills its joins need compile before the clock starts); then, for each
concurrency level, that many clients send the prompts as streamed chat requests, each its next prompt as soon as
its last one ended.
Per level: requests per second, time to first token (mean, p50, p90), each request's tokens per second from
sending it to its last token, the server's total tokens per second, and each request's longest wait between two
streamed chunks (mean, p90, max): what a long prompt's prefill costs the streams already running (the server's
`--prefill-chunk`, one server run per value given).
"""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stream_chat(base: str, model: str, prompt: str, max_tokens: int) -> tuple[float, float, int, float]:
    """One streamed chat request: (seconds to the first content, seconds to the end, completion tokens, the longest
    seconds between two chunks with content after the first)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    request = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first, last, gap, tokens = None, None, 0.0, 0
    with urllib.request.urlopen(request, timeout=3600) as reply:
        for raw in reply:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                gap = max(gap, now - last) if last is not None else gap
                last = now
    end = time.perf_counter()
    return (first or end) - start, end - start, tokens, gap


def _quantiles(values: Sequence[float]) -> dict:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"mean": round(1000 * statistics.fmean(ordered), 1), "p50": round(1000 * pick(0.5), 1),
            "p90": round(1000 * pick(0.9), 1)}


def run_level(base: str, model: str, prompts: Sequence[str], max_tokens: int, concurrency: int) -> dict:
    """Every prompt once, `concurrency` clients at a time."""
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: stream_chat(base, model, p, max_tokens), prompts))
    seconds = time.perf_counter() - start
    tokens = sum(r[2] for r in results)
    return {
        "concurrency": concurrency, "requests": len(results), "seconds": round(seconds, 3),
        "requests_per_second": round(len(results) / seconds, 3),
        "time_to_first_token_ms": _quantiles([r[0] for r in results]),
        "tokens_per_second_per_request": round(statistics.fmean(r[2] / r[1] for r in results), 2),
        "tokens": tokens, "tokens_per_second": round(tokens / seconds, 2),
        "longest_gap_ms": {**_quantiles([r[3] for r in results]), "max": round(1000 * max(r[3] for r in results), 1)},
    }


class InProcessServer:
    """`jaxspec.serve` on a loopback port in this process (a context manager): its parsed arguments in, its base
    URL and scheduler out."""

    def __init__(self, serve_argv: Sequence[str]):
        from jaxspec.cli.args import check_generation_args
        from jaxspec.serve.__main__ import build_parser, build_server

        self.port = free_port()
        self.args = build_parser().parse_args([*serve_argv, "--port", str(self.port)])
        check_generation_args(self.args, tree_sets_depth=True)
        self.app, self.scheduler = build_server(self.args)
        self.base = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> InProcessServer:
        import uvicorn

        self.scheduler.start()
        # log_config None: leave this process's logging alone (uvicorn's own config would replace its handlers).
        # A minute of keep-alive (uvicorn's default: 5 s): a client that pauses longer between requests (a test
        # generating its reference in this process, a loaded CPU) otherwise races the server closing the idle
        # connection and can see "Server disconnected without sending a response".
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_config=None,
                                                    log_level="warning", timeout_keep_alive=60))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 120
        while not self.server.started and time.time() < deadline:
            time.sleep(0.05)
        if not self.server.started:
            raise RuntimeError("the server did not start within 120 s")
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)
        self.scheduler.stop()


def run_load(methods: Sequence[tuple[str, Sequence[str]]], prompts: Sequence[str], max_tokens: int,
             levels: Sequence[int], say=lambda msg: None) -> list[dict]:
    """For each (name, serve argv): start that server, warm it up, measure every concurrency level."""
    out = []
    for name, argv in methods:
        say(f"starting the server: {name}")
        with InProcessServer(argv) as server:
            model = json.loads(urllib.request.urlopen(server.base + "/v1/models", timeout=60).read())["data"][0]["id"]
            # a prefill compiles per (joining rows, prompt bucket), a chunked join's per prompt bucket: each level
            # run once whole first, so that the joins it makes have their programs before the clock starts (one
            # token each left the joins that come with longer answers to compile in the measured run)
            say(f"{name}: warming up (each level once, so that its prefills compile)")
            for level in levels:
                run_level(server.base, model, prompts, max_tokens, level)
            for level in levels:
                say(f"{name}: {len(prompts)} requests, {level} at a time")
                before = _counts(server.scheduler.stats)
                row = run_level(server.base, model, prompts, max_tokens, level)
                generated, completed, calls = (a - b for a, b in zip(_counts(server.scheduler.stats), before))
                # tokens per verify step, the bonus included (each request's first token comes from its prefill)
                accepted = round((generated - completed) / calls, 3) if calls else None
                out.append({"method": name, "slots": server.args.slots, **row, "mean_accepted_length": accepted})
    return out


def _counts(stats) -> tuple[int, int, int]:
    return stats.generated_tokens, stats.completed, stats.verify_calls
