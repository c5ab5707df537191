"""--serving-http: the serving section's Poisson workloads in process and through the
OpenAI-compatible server on 127.0.0.1, side by side, so that the HTTP layer's cost shows.

What is measured. The same requests at the same rates (serving.py's `poisson_runs`: the reference
workload's first requests, EOS ignored), each driven by serving.py's `drive` on two paths:
(a) in process, through the engine step API (`StepClient`): a token counts when `step()` returns
    it;
(b) through `python -m nanograph.serve` in a subprocess on 127.0.0.1, each request a streamed
    POST /v1/completions (`HttpClient`): a token counts when its server-sent event arrives, and
    the request from when the client's event loop sends it (vLLM's benchmark_serving, too, counts
    from just before its POST): `drive` runs in a thread of its own, and the hop from there to
    the client's loop is the bench's cost, not the server's.
From each: tokens/s, TTFT p50/p99 and ITL p50/p99, as serving.py defines them, and HTTP over in
process for ITL p99 and TTFT p50. The difference is what a client pays for the server: the
engine thread's hand-off to the event loop, the JSON chunks, the socket, the client's parsing.
A full run drives each workload REPEATS times on each path and reports each figure's median over
them: one run's p99 moves with a burst of the machine's own noise, and a target judged on one
run would judge the noise.

Why the two compare. One engine at a time (the in-process one is closed before the server
starts: each sizes its KV cache from free memory), both from the same knobs (serving.py's
`serving_knobs`: max_num_seqs 512, no prefix caching, the run's device, dtype and token budgets),
under the engine's own rule (decode-first), each warmed up on the warm-up workload first, on the
same model directory: the shape's config.json (or --model's files) with a word-level tokenizer
(checkpoint.write_tokenizer) in place of any other. A model without a tokenizer streams empty
text, so the tokenizer is what gives every token a chunk; the engine in process detokenizes too.

One chunk is one token. The server sends one chunk per engine step per completion that has new
text; a step gives a completion (n = 1) one token; every token of the word-level tokenizer is
text ("t<id>", special tokens too: the requests ask for skip_special_tokens false). The stream's
usage chunk checks the count at its end.

The client is one asyncio event loop in the bench's process for every stream (as vLLM's
benchmark_serving has): its reads are part of what is measured, and with many streams open (the
highest rates) a share of the HTTP figures is the client's own.

Targets (issue 45, H100, Qwen3-0.6B shape), at a rate that does not saturate the engine: ITL p99
over HTTP <= 1.2x in process, and TTFT p50 over HTTP within 2 decode steps (the in-process run's
step p50) of the in-process TTFT p50, the prompt's prefill as the engine sees it (its wait for
the step under way included). Judged at the lowest rate (4 req/s), on full CUDA runs only.
Needs the server's dependencies (the `serve` extra).
"""
import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from benchmarks.checkpoint import write_tokenizer
from benchmarks.harness import Setup, report_leftover_memory
from benchmarks.report import cell, ms, print_table
from benchmarks.serving import (FULL, QUICK, Scale, ServingResult, ServingRun, Target, drive,
                                engine_figures, poisson_runs, print_engine, ratio, run_rule,
                                serving_engine, serving_knobs, warmup_run)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the server's PYTHONPATH
POLL_SECONDS = 0.5      # HttpClient.step returns after this long even if no chunk came
READY_SECONDS = 900.0   # the server's build (weights, KV cache, graph capture), at most
STOP_SECONDS = 30.0     # after SIGTERM, before the server is killed
REPEATS = 3             # runs of each workload on each path (full runs; --quick: 1)
MEDIAN_FIGURES = ("seconds", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "itl_max", "step_p50")
KEEP_ALIVE_SECONDS = 2.0  # an idle connection is reused this long (the server keeps it 5 s)
TARGET_HTTP = Target("ITL p99 over HTTP <= 1.2x in process; TTFT p50 <= in process + 2 steps",
                     lambda http, local: http.itl_p99 <= 1.2 * local.itl_p99
                     and http.ttft_p50 <= local.ttft_p50 + 2 * local.step_p50)
TOKENIZER_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja"}


# ---- the client --------------------------------------------------------------------------------

@dataclass
class HttpClient:
    """A serving.Client of a running nanograph server. Each request is a streamed POST
    /v1/completions (its token ids, max_tokens, temperature, ignore_eos; special tokens as
    text), sent and read on one asyncio event loop in a background thread, which notes when
    each request went out and when each chunk arrived. One chunk is one token (see the module
    docstring: one chunk per engine step per completion with new text, one token per step at
    n = 1, every token text).

    The HTTP is the standard library's: asyncio streams, HTTP/1.1 connections kept alive and
    reused, as a pooling client (vLLM's benchmark's aiohttp, the openai client's httpx) does, the
    chunked body read line by line (every `data:` line of an event is a line of its own). A
    general-purpose client costs more per request and per chunk than the server's own work at a
    low rate: what is measured should be the server.

    A step is a poll: `step` waits until some stream has sent a chunk (or `timeout`, or
    POLL_SECONDS, has passed), then returns (request, tokens so far, when it arrived) for every
    chunk since the last poll, so that LatencyTrace counts arrivals, not polls.

    With `model`, each request names it (a router such as smg requires the field); with
    `text_prompts`, a prompt goes as the word-level tokenizer's text ("t12 t7 ...", the same
    tokens for the server), for a router that routes on text. With `stream=False`, a request
    asks for one JSON response, and its tokens (the usage count) arrive at once when it ends:
    for throughput at saturation, where reading every chunk of thousands of streams a second
    would make this one thread the limit."""
    url: str
    model: str | None = None
    text_prompts: bool = False
    stream: bool = True
    # from the reader: (request, 0, perf_counter()) when it is sent, (request, tokens so far,
    # perf_counter()) per chunk, then at the stream's end (request, None, None or the exception
    # that ended it)
    events: queue.Queue = field(default_factory=queue.Queue, init=False)
    keys: itertools.count = field(default_factory=itertools.count, init=False)
    # request -> its stream's future, until `step` sees its end. (The event loop keeps only a
    # weak reference to a task, and asyncio's protocol holds its reader weakly: without this,
    # the garbage collector could take a stream midway.)
    streams: dict = field(default_factory=dict, init=False)
    # connections whose last stream has ended: (reader, writer, when it became idle)
    idle: list = field(default_factory=list, init=False)

    def __post_init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-http-client",
                                       daemon=True)
        self.thread.start()

    def add(self, prompt: list[int], params) -> int:
        key = next(self.keys)
        text = " ".join(f"t{token}" for token in prompt) if self.text_prompts else None
        body = {"prompt": text or prompt, "max_tokens": params.max_tokens,
                "temperature": params.temperature, "ignore_eos": params.ignore_eos,
                "skip_special_tokens": False, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.model:
            body["model"] = self.model
        self.streams[key] = asyncio.run_coroutine_threadsafe(self.read(key, body), self.loop)
        return key

    def step(self, timeout: float | None = None) -> list[tuple[int, int, float]]:
        wait = POLL_SECONDS if timeout is None else max(0.0, min(timeout, POLL_SECONDS))
        try:
            events = [self.events.get(timeout=wait)]
        except queue.Empty:
            return []
        while not self.events.empty():  # (one consumer: what is there stays there)
            events.append(self.events.get_nowait())
        arrived = []
        for key, tokens, when in events:
            if tokens is not None:
                arrived.append((key, tokens, when))
                continue
            del self.streams[key]
            if when is not None:
                raise RuntimeError(f"request {key} over HTTP failed: {when!r}") from when
        return arrived

    def busy(self) -> bool:
        return bool(self.streams)

    async def read(self, key: int, body: dict) -> None:
        """One request, on the event loop: an event when it is sent (0 tokens), one per chunk
        with text (a stream) or one with every token (a response), then its end."""
        error, writer = None, None
        self.events.put((key, 0, time.perf_counter()))
        try:
            reader, writer, length = await self.post("/v1/completions", body)
            await (self.read_stream(key, reader, length) if self.stream
                   else self.read_response(key, reader, length))
            self.idle.append((reader, writer, time.monotonic()))  # read to its end: free again
        except Exception as e:  # (not a cancellation: close's)
            error = e
            if writer is not None:
                writer.close()
        self.events.put((key, None, error))

    async def read_stream(self, key: int, reader: asyncio.StreamReader, length: int | None):
        """A chunked SSE body: an event per chunk with text; its tokens checked against the
        usage count."""
        if length is not None:
            raise RuntimeError("a stream without chunked encoding")
        tokens = 0
        async for line in events(reader):
            when = time.perf_counter()
            chunk = json.loads(line)
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                tokens += 1
                self.events.put((key, tokens, when))
            counted = chunk.get("usage", {}).get("completion_tokens", tokens)
            if counted != tokens:
                raise RuntimeError(f"{tokens} chunks with text, {counted} tokens")
        await reader.readuntil(b"\r\n0\r\n\r\n")  # the chunked body's end

    async def read_response(self, key: int, reader: asyncio.StreamReader, length: int | None):
        """One JSON body, of a known length or chunked (as a router may send it): one event
        with its usage count."""
        body = await (reader.readexactly(length) if length is not None else chunked_body(reader))
        completion = json.loads(body)
        self.events.put((key, completion["usage"]["completion_tokens"], time.perf_counter()))

    async def post(self, path: str, body: dict):
        """Send a POST; read its status line and headers. The connection's (reader, writer),
        positioned at the body, and the body's Content-Length (None: chunked)."""
        reader, writer = await self.connection()
        data = json.dumps(body).encode()
        writer.write(f"POST {path} HTTP/1.1\r\nHost: bench\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                     .encode() + data)
        status = (await reader.readline()).decode()
        headers = []
        while (line := await reader.readline()).strip():  # (b"": the connection closed)
            headers.append(line.decode().lower())
        if " 200 " not in status:
            writer.close()
            raise RuntimeError(f"{status.strip()}: {(await reader.read(4096)).decode()}")
        lengths = [int(line.partition(":")[2]) for line in headers
                   if line.startswith("content-length:")]
        if not lengths and "transfer-encoding: chunked\r\n" not in headers:
            writer.close()
            raise RuntimeError(f"a body neither chunked nor of a known length: {headers}")
        return reader, writer, lengths[0] if lengths else None

    async def connection(self):
        """An idle connection young enough that the server keeps it (uvicorn closes one idle
        for 5 s), or a new one."""
        while self.idle:
            reader, writer, since = self.idle.pop()
            if time.monotonic() - since < KEEP_ALIVE_SECONDS and not reader.at_eof():
                return reader, writer
            writer.close()
        address = urllib.parse.urlsplit(self.url)
        return await asyncio.open_connection(address.hostname, address.port)

    async def shutdown(self) -> None:
        for _, writer, _ in self.idle:
            writer.close()
        streams = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in streams:
            task.cancel()
        await asyncio.gather(*streams, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.shutdown(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


async def chunked_body(reader: asyncio.StreamReader) -> bytes:
    """A chunked body's bytes, read to its end."""
    parts = []
    while size := int((await reader.readline()).strip(), 16):
        parts.append(await reader.readexactly(size))
        await reader.readline()  # (the chunk's CRLF)
    await reader.readline()  # (the body's last CRLF)
    return b"".join(parts)


async def events(reader: asyncio.StreamReader):
    """The JSON of each `data:` event of a chunked SSE body, up to `data: [DONE]`."""
    while (line := await reader.readline()) != b"data: [DONE]\n":
        if not line:
            raise RuntimeError("the stream ended without data: [DONE]")
        if line.startswith(b"data: "):  # (not a chunk-size line or a blank one)
            yield line[len(b"data: "):]


# ---- the server --------------------------------------------------------------------------------

def as_flags(knobs: dict) -> list[str]:
    """LLM keyword arguments as nanograph-serve's flags (one per Config field: serve/cli.py)."""
    flags = []
    for name, value in knobs.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else flag.replace("--", "--no-", 1))
        else:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """`python -m nanograph.serve MODEL --host 127.0.0.1` on a free port, with the LLM's knobs as
    flags (and `flags`) and its output in `log`; entered once /health answers 200, left by SIGTERM
    (and a kill if it lingers)."""
    model_dir: str
    knobs: dict
    log: str
    flags: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    startup_seconds: float | None = None  # from the start to /health's 200

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        command = [sys.executable, "-m", "nanograph.serve", self.model_dir, "--host", "127.0.0.1",
                   "--port", str(self.port), *as_flags(self.knobs), *self.flags]
        path = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
        start = time.perf_counter()
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": path},
                                         stdout=log, stderr=subprocess.STDOUT)
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.perf_counter() - start
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_SECONDS
        while self.proc.poll() is None and time.monotonic() < deadline:
            # an HTTPError (503: not ready) or a URLError (the port is not open yet)
            with contextlib.suppress(urllib.error.URLError):
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    return
            time.sleep(0.1)
        with open(self.log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"the server did not become ready (exit status {self.proc.poll()}); "
                           f"the end of its log, {self.log}:\n{tail}")

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            print(f"  (the server outlived SIGTERM by {STOP_SECONDS:.0f} s: killed)")
            self.proc.kill()
            self.proc.wait()

    def __exit__(self, *exc):
        self.stop()


def tokenized_model_dir(setup: Setup) -> str:
    """The setup's model with a word-level tokenizer in place of its own (its other files
    linked), in the run's temporary directory; made once."""
    from transformers import AutoConfig
    path = os.path.join(setup.tmp, os.path.basename(setup.model_dir.rstrip("/")) + "-tokenized")
    if not os.path.isdir(path):
        os.makedirs(path)
        for name in set(os.listdir(setup.model_dir)) - TOKENIZER_FILES:
            os.symlink(os.path.join(setup.model_dir, name), os.path.join(path, name))
        write_tokenizer(path, AutoConfig.from_pretrained(setup.model_dir))
    return path


# ---- the runs ----------------------------------------------------------------------------------

def run_in_process(setup: Setup, scale: Scale, runs: list[ServingRun],
                   repeats: int) -> tuple[dict, list]:
    """The runs through the step API on an engine of the section's knobs, freed at the end:
    (its figures, a ServingResult per run, the median of its repeats)."""
    llm = serving_engine(setup, scale)
    try:
        engine = engine_figures(llm)
        run_rule(llm, setup, warmup_run(setup), "decode-first")
        results = [median_run([run_rule(llm, setup, run, "decode-first") for _ in range(repeats)])
                   for run in runs]
    finally:
        llm.close()
        del llm
        report_leftover_memory("the in-process engine")
    return engine, results


def run_http(client: HttpClient, run: ServingRun) -> ServingResult:
    gc.collect()  # not in the middle of a run
    result = ServingResult.of(run.name, "decode-first", run.max_num_seqs,
                              drive(client, run.workload, run.arrivals), {"steps": {}})
    return dataclasses.replace(result, gap_steps_max=None, step_p50=None)  # polls, not steps


def median_run(results: list[ServingResult]) -> ServingResult:
    """Repeated runs of one workload as one: each figure of MEDIAN_FIGURES the median of the
    runs' (those a path does not have stay None); the counts, the same in every run, the first's."""
    figures = {name: statistics.median(getattr(r, name) for r in results)
               for name in MEDIAN_FIGURES if getattr(results[0], name) is not None}
    return dataclasses.replace(results[0], **figures)


@dataclass
class PathsRow:
    """One workload in process and over HTTP: a pair of rows of the table."""
    run: ServingRun
    local: ServingResult
    http: ServingResult
    judge: bool

    @property
    def itl_p99_ratio(self) -> float | None:
        return ratio(self.http.itl_p99, self.local.itl_p99)

    @property
    def ttft_p50_ratio(self) -> float | None:
        return ratio(self.http.ttft_p50, self.local.ttft_p50)

    @property
    def target(self) -> str | None:
        return self.run.target.text if self.run.target else None

    @property
    def met(self) -> bool | None:
        if self.run.target is None or not self.judge:
            return None
        return self.run.target.met(self.http, self.local)

    def to_dict(self) -> dict:
        return {"workload": self.run.name, "in_process": self.local.to_dict(),
                "http": self.http.to_dict(), "itl_p99_http_vs_in_process": self.itl_p99_ratio,
                "ttft_p50_http_vs_in_process": self.ttft_p50_ratio, "target": self.target,
                "met": self.met}


def print_paths(rows: list[PathsRow]) -> None:
    table = []
    for row in rows:
        for path, r in (("in process", row.local), ("HTTP", row.http)):
            figures = [f"{r.tokens_per_s:,.0f}", cell(ms(r.ttft_p50), ".1f"),
                       cell(ms(r.ttft_p99), ".1f"), cell(ms(r.itl_p50), ".2f"),
                       cell(ms(r.itl_p99), ".2f")]
            ratios = ["-"] * 4
            if r is row.http:
                met = "-" if row.met is None else "yes" if row.met else "NO"
                ratios = [cell(row.itl_p99_ratio, ".3f", "x"), cell(row.ttft_p50_ratio, ".3f", "x"),
                          row.target or "-", met]
            table.append([row.run.name, path, *figures, *ratios])
    print_table("Serving in process (the step API) and over HTTP (nanograph.serve on 127.0.0.1, "
                "streamed /v1/completions), the same Poisson workloads, decode-first; ms; a token "
                "counts when step() returns it / when its chunk arrives",
                ["workload", "path", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                 "ITL p99 HTTP/in", "TTFT p50 HTTP/in", "target", "met"], table)
    print("  target: issue 45, on an H100, Qwen3-0.6B shape, at a rate that does not saturate "
          "the engine (the lowest); judged on full runs on CUDA only")


def section_serving_http(setup: Setup) -> dict:
    scale = QUICK if setup.args.quick else FULL
    setup = dataclasses.replace(setup, model_dir=tokenized_model_dir(setup))
    runs = poisson_runs(setup, scale)
    runs[0] = dataclasses.replace(runs[0], target=TARGET_HTTP)  # the lowest rate
    print(f"  [serving-http] {len(runs)} Poisson workloads in process, then through a server on "
          f"127.0.0.1 ...", flush=True)
    repeats = 1 if setup.args.quick else REPEATS
    engine, local = run_in_process(setup, scale, runs, repeats)
    knobs = setup.llm_kwargs(**serving_knobs(setup, scale))
    with (ServerProcess(setup.model_dir, knobs, setup.model_dir + ".server.log") as server,
          HttpClient(server.url) as client):
        drive(client, setup.warmup, warmup_run(setup).arrivals)
        http = [median_run([run_http(client, run) for _ in range(repeats)]) for run in runs]
    print_engine(engine)
    print(f"  the server: ready {server.startup_seconds:.1f} s after its start (build, KV cache, "
          f"graphs); {' '.join(as_flags(knobs))}")
    judge = engine["num_graphs"] is not None and not setup.args.quick
    rows = [PathsRow(*paths, judge) for paths in zip(runs, local, http)]
    print_paths(rows)
    print(f"  each figure: its median over {repeats} run(s) of the workload on the path")
    return {"engine": engine, "server_flags": as_flags(knobs),
            "server_startup_seconds": server.startup_seconds, "repeats": repeats,
            "runs": [row.to_dict() for row in rows]}
