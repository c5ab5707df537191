"""Prometheus metrics, vLLM's names under `nanograph:` (each labelled with `model_name`, as
vLLM's dashboards select them), and the CUDA graphs' own.

Latencies are taken in the engine thread, as each step's dicts come out: queue time (arrival to
the start of the step that first schedules the request), time to first token (from the
request's arrival), inter-token latency (between two steps that gave a request tokens: the
decode rhythm a user sees, apart from the prefill-bound first token), end to end.
The gauges are set after every step from the scheduler, the block manager and `llm.stats()`;
prometheus_client's metrics are thread-safe, so /metrics reads them from the event loop.

The three gauges a router reads to pick a replica (waiting and running requests, KV cache usage)
are also under vLLM's own names, `vllm:...`, which routers expect by default: llm-d's endpoint
picker (the Gateway API inference extension) reads vllm:num_requests_waiting and
vllm:kv_cache_usage_perc, and the older vllm:gpu_cache_usage_perc.
"""
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = [0.001 * 2**i for i in range(17)]  # 1 ms to 65 s, doubling
TOKEN_BUCKETS = [2**i for i in range(21)]            # 1 to a million tokens

# llm.stats() key -> (gauge, what it says); absent keys (no graphs) leave the gauge at 0
STATS_GAUGES = {
    "graph_hit_rate": ("decode_graph_hit_rate", "Share of decode steps that replayed a graph"),
    "padding_waste": ("decode_graph_padding_waste", "Padded rows per real row in decode replays"),
    "mixed_graph_hit_rate": ("mixed_graph_hit_rate", "Share of mixed steps that replayed a graph"),
    "num_graphs": ("num_cuda_graphs", "CUDA graphs captured"),
    "graph_memory_bytes": ("cuda_graph_memory_bytes", "Memory of the graphs' shared pool"),
    "prefix_cache_hit_tokens": ("prefix_cache_hit_tokens", "Prompt tokens found in the cache"),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", "Verifies of a sequence's drafts"),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens verified"),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", "Drafts accepted"),
}


@dataclass
class RouterGauge:
    """One value under nanograph's name and vLLM's."""
    gauges: list[Gauge]

    def set(self, value: float):
        for gauge in self.gauges:
            gauge.set(value)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def make(kind, name: str, doc: str, **kwargs):
            return kind(f"nanograph:{name}", doc, ["model_name"], registry=self.registry,
                        **kwargs).labels(model_name)

        def router_gauge(name: str, doc: str, *old_names: str) -> RouterGauge:
            """nanograph:NAME and vllm:NAME (and vLLM's OLD_NAMES for it)."""
            return RouterGauge([make(Gauge, name, doc)] + [
                Gauge(f"vllm:{vllm_name}", doc, ["model_name"], registry=self.registry
                      ).labels(model_name) for vllm_name in (name, *old_names)])

        self.ttft = make(Histogram, "time_to_first_token_seconds", "Time to first token",
                         buckets=LATENCY_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Time between two steps' tokens",
                        buckets=LATENCY_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Arrival to finish",
                        buckets=LATENCY_BUCKETS)
        self.queue_time = make(Histogram, "request_queue_time_seconds",
                               "Arrival to the step that first schedules it",
                               buckets=LATENCY_BUCKETS)
        self.request_prompt_tokens = make(Histogram, "request_prompt_tokens",
                                          "Prompt tokens per request", buckets=TOKEN_BUCKETS)
        self.request_generation_tokens = make(Histogram, "request_generation_tokens",
                                              "Tokens generated per request (its n completions)",
                                              buckets=TOKEN_BUCKETS)
        self.success = Counter("nanograph:request_success", "Completions finished, by reason",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.preemptions = make(Counter, "num_preemptions", "Sequences preempted")
        self.num_preempted = 0  # the scheduler's count when last read
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated")
        self.running = router_gauge("num_requests_running", "Sequences running")
        self.waiting = router_gauge("num_requests_waiting", "Sequences waiting")
        self.kv_usage = router_gauge("kv_cache_usage_perc", "Share of KV blocks in use (0 to 1)",
                                     "gpu_cache_usage_perc")
        self.stats = {key: make(Gauge, name, doc) for key, (name, doc) in STATS_GAUGES.items()}
        self.stats_time = -1.0

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
        """The gauges, from the LLM's state after a step (in the engine thread). llm.stats()
        takes tens of microseconds: once a second, and when the engine goes idle."""
        self.running.set(len(llm.scheduler.running))
        self.waiting.set(len(llm.scheduler.waiting))
        blocks = llm.block_manager
        self.kv_usage.set(1 - blocks.num_free_blocks / len(blocks.blocks))
        if now - self.stats_time < 1 and llm.has_unfinished_requests():
            return
        self.stats_time = now
        stats = llm.stats()
        self.preemptions.inc(stats["preemptions"] - self.num_preempted)
        self.num_preempted = stats["preemptions"]
        for key, gauge in self.stats.items():
            if key in stats:
                gauge.set(stats[key])

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
