"""--serving-http --data-parallel-size N: N replicas behind SGLang's router (smg) against one.

What is measured. The same requests over HTTP, as --serving-http's HTTP path sends them
(`HttpClient`, serving.py's `drive`), to three servers in turn, each started, warmed up, driven
and stopped:
(a) one replica: `python -m nanograph.serve` on its own (one GPU);
(b) `--data-parallel-size N --router-policy cache_aware`: N replicas (a GPU each) behind smg;
(c) the same under `round_robin`.
Every server has the serving section's knobs (`serving_knobs`) with prefix caching on. From each
run: tokens/s, TTFT and ITL as serving.py defines them, and the prefix-cache hit rate: the
replicas' prompt tokens found in their caches over their prompt tokens (each replica's /metrics,
read before and after the run; smg's /workers lists them), and the busiest replica's share of
the prompt tokens (how evenly the router spread the work).

The workloads:
- serving.py's Poisson runs (4, 16, 64 req/s; --quick: 10, 40). The lowest rate shows the
  router's own cost (ITL p99 against one replica's). The highest does not saturate two
  replicas: its last requests' decodes, at a small batch, make most of its time.
- shared prefix: SYSTEMS system prompts, USERS users each (32 x 16 = 512 requests: a system
  prompt of 1,024 random tokens, a user turn of 32-96, 64 new tokens), the 512 in a shuffled order,
  Poisson arrivals. Under cache_aware a system prompt's requests go where it is cached; under
  round_robin every replica computes and caches every system prompt. The hit rates differ only
  when a replica's KV cache cannot hold them all: so after the three servers, the two policies
  run it again on servers whose caches hold half the system prompts (`contrast_blocks`: what a
  replica keeps under cache_aware, plus room for the running requests), every request at t=0.
  (Under LRU eviction and requests in random order, round_robin's hit rate then falls to about
  the cache's share of the system prompts, and cache_aware's stays at (users - 1) / users.)
- saturation: 1,024 requests at once (prompts of 64-256 tokens, exactly 512 new tokens each):
  two full waves of 512 seats on one replica, one on each of two, and equal lengths, so no tail.
  Long enough that the burst's start counts little: smg passes 1,024 new connections on over
  a second or so, which in a run of a few seconds decides the ratio (docs/experiments.md).
  Not streamed (`HttpClient(stream=False)`): one JSON response a request, so that the client's
  one thread, reading tens of thousands of chunks a second, is not what is measured; its rows
  have tokens/s and no token times.

Prompts go as text ("t12 t7 ...", the word-level tokenizer's words: the same tokens for the
server), since smg's cache_aware policy matches request text. Every run's prompts start with a
token of their own (its index, the same for every server): the prefix cache's block hashes chain
from the first token, so no run finds an earlier run's prompts cached, and the router's tree no
earlier run's text.

Targets (issue 56, two H100s, Qwen3-0.6B shape; judged on full CUDA runs only): at
saturation, N replicas under cache_aware reach >= 0.95 N x one replica's tokens/s; at the
lowest rate, their ITL p99 is within 1.1x of one replica's; on the shared prefix with the small
caches, cache_aware's hit rate is >= 2x round_robin's, with more tokens/s.
"""
import dataclasses
import json
import random
import time
import urllib.request
from dataclasses import dataclass

from benchmarks.harness import Setup
from benchmarks.report import cell, ms, print_table
from benchmarks.serving import (FULL, QUICK, ServingResult, ServingRun, drive, poisson_arrivals,
                                poisson_runs, ratio, serving_knobs, warmup_run)
from benchmarks.serving_http import HttpClient, ServerProcess, run_http, tokenized_model_dir
from benchmarks.workloads import Workload, make_workload
from nanograph.config import Config


@dataclass(frozen=True)
class SharedPrefix:
    """The shared-prefix workload's sizes."""
    systems: int
    users: int
    system_len: int
    user_lens: tuple[int, int]
    output_len: int
    rate: float  # requests/s, Poisson


FULL_SHARED = SharedPrefix(32, 16, 1024, (32, 96), 64, 64.0)
QUICK_SHARED = SharedPrefix(4, 4, 48, (4, 8), 4, 40.0)


@dataclass(frozen=True)
class Saturation:
    """The saturation workload's sizes: `requests` at t=0, prompts of `prompt_lens` tokens,
    each asking for exactly `output_len` (equal lengths: no tail of a few long ones)."""
    requests: int
    prompt_lens: tuple[int, int]
    output_len: int


FULL_SATURATION = Saturation(1024, (64, 256), 512)  # two waves of 512 seats on one replica
QUICK_SATURATION = Saturation(16, (8, 24), 4)


def saturation_run(setup: Setup, sizes: Saturation) -> ServingRun:
    workload = make_workload(sizes.requests, *sizes.prompt_lens, sizes.output_len,
                             sizes.output_len, max_token_id=setup.max_token_id, seed=3)
    return ServingRun(f"saturation, {sizes.requests} at once, not streamed", workload, 512,
                      [0.0] * sizes.requests, streamed=False)


def shared_prefix_run(setup: Setup, sizes: SharedPrefix, seed: int = 2) -> ServingRun:
    rng = random.Random(seed)
    systems = [[rng.randint(0, setup.max_token_id) for _ in range(sizes.system_len)]
               for _ in range(sizes.systems)]
    prompts = [system + [rng.randint(0, setup.max_token_id)
                         for _ in range(rng.randint(*sizes.user_lens))]
               for system in systems for _ in range(sizes.users)]
    rng.shuffle(prompts)
    workload = Workload(prompts, [sizes.output_len] * len(prompts))
    name = f"shared prefix, {sizes.systems} x {sizes.users}"
    return ServingRun(name, workload, 512, poisson_arrivals(len(prompts), sizes.rate))


HEADROOM_BLOCKS = 16  # the contrast's cache beyond the system prompts: the running requests


def contrast_blocks(sizes: SharedPrefix, block_size: int) -> int:
    """A replica's KV blocks for the shared-prefix contrast: half the system prompts (what one
    of two replicas holds under cache_aware), not all of them, and room for the running."""
    system_blocks = sizes.systems * -(-sizes.system_len // block_size)
    return system_blocks // 2 + HEADROOM_BLOCKS


def contrast_run(setup: Setup, sizes: SharedPrefix) -> ServingRun:
    """The shared-prefix workload with every request at t=0 (tokens/s then measures the work
    the caches save, not the arrival rate)."""
    run = shared_prefix_run(setup, sizes)
    return dataclasses.replace(run, name=f"{run.name}, at once",
                               arrivals=[0.0] * len(run.arrivals))


def salted(run: ServingRun, salt: int) -> ServingRun:
    """The run with `salt` as every prompt's first token."""
    prompts = [[salt] + prompt for prompt in run.workload.prompts]
    return dataclasses.replace(run, workload=dataclasses.replace(run.workload, prompts=prompts))


def replica_urls(server: ServerProcess, replicas: int) -> list[str]:
    """The replicas behind the server's port: smg's workers, or the server itself."""
    if replicas == 1:
        return [server.url]
    with urllib.request.urlopen(server.url + "/workers") as answer:
        return [worker["url"] for worker in json.load(answer)["workers"]]


def wait_for_workers(server: ServerProcess, replicas: int, seconds: float = 60.0) -> None:
    """smg answers /health as soon as it listens, and registers its workers a moment later
    (asking each for its model): until then a request gets its 404 "No worker available". Wait
    until its /workers lists them all."""
    deadline = time.monotonic() + seconds
    while len(replica_urls(server, replicas)) < replicas:
        if time.monotonic() > deadline:
            raise RuntimeError(f"smg registered fewer than {replicas} workers in {seconds:.0f} s")
        time.sleep(0.1)


def cache_counters(urls: list[str]) -> list[tuple[float, float]]:
    """Each replica's (prompt tokens found in its prefix cache, prompt tokens)."""
    counters = []
    for url in urls:
        hits = prompt = 0.0
        for line in urllib.request.urlopen(url + "/metrics").read().decode().splitlines():
            labelled_name, _, value = line.partition(" ")
            name = labelled_name.partition("{")[0]  # (each is labelled with the model's name)
            if name == "nanograph:prefix_cache_hit_tokens":
                hits += float(value)
            elif name == "nanograph:prompt_tokens_total":
                prompt += float(value)
        counters.append((hits, prompt))
    return counters


@dataclass
class ReplicasResult:
    """One workload on one server: a row of the table."""
    server: str
    result: ServingResult
    hit_rate: float | None
    busiest_share: float | None  # the busiest replica's share of the prompt tokens

    @classmethod
    def of(cls, server: str, result: ServingResult, before: list, after: list):
        """The row, from each replica's cache counters before and after the run."""
        hits = [hits_after - hits_before
                for (hits_after, _), (hits_before, _) in zip(after, before)]
        prompt = [prompt_after - prompt_before
                  for (_, prompt_after), (_, prompt_before) in zip(after, before)]
        return cls(server, result, ratio(sum(hits), sum(prompt)), ratio(max(prompt), sum(prompt)))

    def to_dict(self) -> dict:
        return {"server": self.server, **self.result.to_dict(), "hit_rate": self.hit_rate,
                "busiest_share": self.busiest_share}


def run_server(setup: Setup, knobs: dict, server_name: str, flags: list[str], replicas: int,
               runs: list[ServingRun]) -> tuple[list[ReplicasResult], float]:
    """Start the server, warm it up, drive each run (salted by its index); stop it.
    (the rows, its start-up seconds)."""
    log = f"{setup.model_dir}.{replicas}.{len(flags)}.server.log"
    with (ServerProcess(setup.model_dir, knobs, log, flags) as server,
          HttpClient(server.url, model=setup.model_dir, text_prompts=True) as streams,
          HttpClient(server.url, model=setup.model_dir, text_prompts=True,
                     stream=False) as responses):
        wait_for_workers(server, replicas)
        drive(streams, setup.warmup, warmup_run(setup).arrivals)
        urls = replica_urls(server, replicas)
        rows = []
        for salt, run in enumerate(runs, start=1):
            before = cache_counters(urls)
            result = run_http(streams if run.streamed else responses, salted(run, salt))
            rows.append(ReplicasResult.of(server_name, result, before, cache_counters(urls)))
    return rows, server.startup_seconds


def print_replicas(runs: list[ServingRun], rows: dict[str, list[ReplicasResult]]) -> None:
    table = []
    one = next(iter(rows.values()))
    for i, run in enumerate(runs):
        for server, results in rows.items():
            r, base = results[i].result, one[i].result
            latency = ([cell(ms(r.ttft_p50), ".1f"), cell(ms(r.ttft_p99), ".1f"),
                        cell(ms(r.itl_p50), ".2f"), cell(ms(r.itl_p99), ".2f")]
                       if run.streamed else ["-"] * 4)  # (one response: no token times)
            table.append([run.name, server, f"{r.tokens_per_s:,.0f}", *latency,
                          cell(results[i].hit_rate, ".3f"),
                          cell(results[i].busiest_share, ".2f"),
                          cell(ratio(r.tokens_per_s, base.tokens_per_s), ".2f", "x"),
                          cell(ratio(r.itl_p99, base.itl_p99), ".3f", "x")
                          if run.streamed else "-"])
    print_table("Data parallel over HTTP: one replica, and replicas behind smg under two "
                "policies; the same requests (prompts as text), prefix caching on; ms",
                ["workload", "server", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                 "prefix hit rate", "busiest replica", "tok/s vs 1", "ITL p99 vs 1"], table)


def print_contrast(run: ServingRun, rows: dict[str, list[ReplicasResult]], blocks: int) -> None:
    print_table(f"The shared prefix with a cache that holds half the system prompts: "
                f"{blocks} KV blocks a replica, every request at t=0; ms",
                ["workload", "server", "tok/s", "TTFT p50", "TTFT p99", "prefix hit rate",
                 "busiest replica"],
                [[run.name, server, f"{r.result.tokens_per_s:,.0f}",
                  cell(ms(r.result.ttft_p50), ".1f"), cell(ms(r.result.ttft_p99), ".1f"),
                  cell(r.hit_rate, ".3f"), cell(r.busiest_share, ".2f")]
                 for server, (r,) in rows.items()])


def judge(runs: list[ServingRun], rows: dict[str, list[ReplicasResult]],
          contrast: dict[str, list[ReplicasResult]], size: int) -> list:
    """Issue 56's targets: (what, met)."""
    one, cache_aware, _ = (results for results in rows.values())
    (shared_cache_aware,), (shared_round_robin,) = contrast.values()
    lowest, saturation = 0, len(runs) - 1
    return [(f"at saturation, tok/s >= {0.95 * size:.2f}x one replica's",
             cache_aware[saturation].result.tokens_per_s
             >= 0.95 * size * one[saturation].result.tokens_per_s),
            ("at the lowest rate, ITL p99 <= 1.1x one replica's",
             cache_aware[lowest].result.itl_p99 <= 1.1 * one[lowest].result.itl_p99),
            ("shared prefix, half-size cache: cache_aware's hit rate >= 2x round_robin's, "
             "more tok/s",
             shared_cache_aware.hit_rate >= 2 * shared_round_robin.hit_rate
             and shared_cache_aware.result.tokens_per_s
             > shared_round_robin.result.tokens_per_s)]


def section_data_parallel(setup: Setup) -> dict:
    quick, size = setup.args.quick, setup.args.data_parallel_size
    scale = QUICK if quick else FULL
    setup = dataclasses.replace(setup, model_dir=tokenized_model_dir(setup))
    shared = QUICK_SHARED if quick else FULL_SHARED
    runs = [*poisson_runs(setup, scale), shared_prefix_run(setup, shared),
            saturation_run(setup, QUICK_SATURATION if quick else FULL_SATURATION)]
    # prefix caching on; on the CPU, blocks small enough for the quick system prompts to fill
    knobs = setup.llm_kwargs(**serving_knobs(setup, scale) | {"enable_prefix_caching": True})
    if quick:
        knobs["kvcache_block_size"] = 16
    policies = {f"{size} replicas, {policy}":
                ["--data-parallel-size", str(size), "--router-policy", policy]
                for policy in ("cache_aware", "round_robin")}
    print(f"  [serving-http] {len(runs)} workloads on one replica, then on {size} behind smg "
          f"(cache_aware, round_robin); the shared prefix again on small caches ...", flush=True)
    rows, contrast, startup = {}, {}, {}
    for name, flags in {"1 replica": [], **policies}.items():
        replicas = size if flags else 1
        rows[name], startup[name] = run_server(setup, knobs, name, flags, replicas, runs)
        print(f"  {name}: ready {startup[name]:.1f} s after its start", flush=True)
    blocks = contrast_blocks(shared, knobs.get("kvcache_block_size", Config.kvcache_block_size))
    small_cache = knobs | {"num_kvcache_blocks": blocks}
    at_once = contrast_run(setup, shared)
    for name, flags in policies.items():
        contrast[name], _ = run_server(setup, small_cache, name, flags, size, [at_once])
    print_replicas(runs, rows)
    print_contrast(at_once, contrast, blocks)
    targets = judge(runs, rows, contrast, size)
    full_cuda = not quick and setup.device == "cuda"
    for what, met in targets:
        print(f"  target: {what}: {('yes' if met else 'NO') if full_cuda else '-'}")
    return {"data_parallel_size": size, "startup_seconds": startup,
            "runs": {name: [row.to_dict() for row in results] for name, results in rows.items()},
            "shared_prefix_small_cache": {"num_kvcache_blocks": blocks, **{
                name: row.to_dict() for name, (row,) in contrast.items()}},
            "targets": [{"target": what, "met": met if full_cuda else None}
                        for what, met in targets]}
