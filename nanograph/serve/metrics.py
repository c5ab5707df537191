"""Prometheus metrics, vLLM's names under `nanograph:` (each labelled with `model_name`, as
vLLM's dashboards select them), and the CUDA graphs' own.

Latencies are taken in the engine thread, as each step's dicts come out: queue time (arrival to
the start of the step that first schedules the request), time to first token (from the
request's arrival), inter-token latency (between two steps that gave a request tokens: the
decode rhythm a user sees, apart from the prefill-bound first token), end to end.
The router's gauges are read from the scheduler and the block manager when /metrics is
scraped; `llm.stats()`'s numbers, each a gauge of the same name, are set after steps;
prometheus_client's metrics are thread-safe, so /metrics reads them from the event loop.

The three gauges a router reads to pick a replica (waiting and running requests, KV cache usage)
are also under vLLM's own names, `vllm:...`, which routers expect by default: llm-d's endpoint
picker (the Gateway API inference extension) reads vllm:num_requests_waiting and
vllm:kv_cache_usage_perc, and the older vllm:gpu_cache_usage_perc.
"""
from functools import partial

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = [0.001 * 2**i for i in range(17)]  # 1 ms to 65 s, doubling
TOKEN_BUCKETS = [2**i for i in range(21)]            # 1 to a million tokens


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name

        latency = partial(self.metric, Histogram, buckets=LATENCY_BUCKETS)
        self.ttft = latency("time_to_first_token_seconds", "Time to first token")
        self.itl = latency("inter_token_latency_seconds", "Time between two steps' tokens")
        self.e2e = latency("e2e_request_latency_seconds", "Arrival to finish")
        self.queue_time = latency("request_queue_time_seconds",
                                  "Arrival to the step that first schedules it")
        tokens = partial(self.metric, Histogram, buckets=TOKEN_BUCKETS)
        self.request_prompt_tokens = tokens("request_prompt_tokens", "Prompt tokens per request")
        self.request_generation_tokens = tokens("request_generation_tokens",
                                                "Tokens generated per request (its n completions)")
        self.success = Counter("nanograph:request_success", "Completions finished, by reason",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.preemptions = self.metric(Counter, "num_preemptions", "Sequences preempted")
        self.num_preempted = 0  # the scheduler's count when last read
        self.prompt_tokens = self.metric(Counter, "prompt_tokens",
                                         "Prompt tokens of finished requests")
        self.generation_tokens = self.metric(Counter, "generation_tokens", "Tokens generated")
        self.stats = {}  # llm.stats() key -> its gauge, made when the key first shows up
        self.stats_time = -1.0

    def metric(self, kind, name: str, doc: str, **kwargs):
        """nanograph:NAME, a `kind` (Gauge, Counter, Histogram) of this server's model."""
        return kind(f"nanograph:{name}", doc, ["model_name"], registry=self.registry,
                    **kwargs).labels(self.model_name)

    def watch(self, llm):
        """The gauges a router reads, as nanograph:NAME, vllm:NAME and vLLM's older names: read
        from `llm` whenever /metrics is scraped (lengths of its queues: safe from any thread)."""
        blocks = llm.block_manager
        for names, doc, read in (
                (["num_requests_running"], "Sequences running", lambda: len(llm.scheduler.running)),
                (["num_requests_waiting"], "Sequences waiting", lambda: len(llm.scheduler.waiting)),
                (["kv_cache_usage_perc", "gpu_cache_usage_perc"], "Share of KV blocks in use",
                 lambda: 1 - blocks.num_free_blocks / len(blocks.blocks))):
            vllm_gauges = [Gauge(f"vllm:{name}", doc, ["model_name"], registry=self.registry)
                           for name in names]
            self.metric(Gauge, names[0], doc).set_function(read)
            for gauge in vllm_gauges:
                gauge.labels(self.model_name).set_function(read)

    def record(self, job, out: dict, now: float):
        """A step dict of `job` (engine_thread.Job) came out at `now`."""
        num_tokens = sum(len(c["token_ids"]) for c in out["outputs"])
        if num_tokens > job.num_tokens:
            if job.num_tokens == 0:
                self.ttft.observe(now - job.arrival)
            else:
                self.itl.observe(now - job.last_token_time)
            self.generation_tokens.inc(num_tokens - job.num_tokens)
            job.num_tokens = num_tokens
            job.last_token_time = now
        if out["finished"]:
            num_prompt_tokens = len(out["prompt_token_ids"])
            self.e2e.observe(now - job.arrival)
            self.prompt_tokens.inc(num_prompt_tokens)
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(num_tokens)
            for completion in out["outputs"]:
                self.success.labels(self.model_name, completion["finish_reason"]).inc()

    def update(self, llm, now: float):
        """The gauges of llm.stats(), after a step (in the engine thread): it takes tens of
        microseconds, so once a second, and when the engine goes idle."""
        if now - self.stats_time < 1 and llm.has_unfinished_requests():
            return
        self.stats_time = now
        stats = llm.stats()
        self.preemptions.inc(stats["preemptions"] - self.num_preempted)
        self.num_preempted = stats["preemptions"]
        for key, value in stats.items():
            if isinstance(value, (int, float)):  # (not the lists and dicts)
                if key not in self.stats:
                    self.stats[key] = self.metric(Gauge, key, f"llm.stats()[{key!r}]")
                self.stats[key].set(value)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
