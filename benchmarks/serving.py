"""--serving: latency as a server's clients see it, under the two scheduling rules side by side.

What is measured. Requests go in through the engine step API (`add_request`, `step`), each once
its arrival time has passed, as a server feeds them: all at t=0 (continuous admission: a request
is admitted when another finishes) or Poisson arrivals at a given rate. The host notes when each
request arrived and when each of its tokens came back: the time `step()` returned it, and which
step that was (`LatencyTrace`). From that trace:
- tokens/s: output tokens / wall time, from t=0 to the last token;
- TTFT, time to first token: its first token minus its arrival (queueing included: a client
  waits for it too), p50 / p99 over the requests;
- ITL, inter-token latency: the time between two consecutive tokens of a request, p50 / p99 /
  max over all of them (max = the longest gap any sequence saw). A step gives a request at most
  one token (n = 1), so a gap is one step or more; the longest gap is also counted in steps,
  which is deterministic where all requests arrive at t=0;
- step p50: the interval between consecutive `step()` returns while something runs;
- steps by kind (decode / mixed / prefill, the scheduler's counts) and, with CUDA graphs, the
  share of mixed steps that replayed a graph (timing.call_figures around the run).
With overlap scheduling (on with CUDA) `step()` returns the tokens of the step launched one call
earlier: that is when a client can have them, so that is what counts.

Why the rules compare. One engine per shape (built with max_num_seqs=512, so graphs up to 512)
runs every workload twice, back to back: under the decode-first rule (the engine's) and under
the old prefill-first one (a prefill-only step whenever a prompt can be admitted:
`RuleScheduler.prefill_first`, a switch this section adds to the engine's scheduler). Both runs
get the same prompts, output lengths (EOS ignored) and arrival times; between workloads only
`scheduler.max_num_seqs` changes. Prefix caching is off, so a run finds nothing of an earlier
run's prompts in the cache. A warm-up under each rule (a few short requests) comes first.

The workloads (issue 43; its targets print with the ratios):
- the reference workload (workloads.py), all at t=0, max_num_seqs=64 (continuous admission)
  and 512 (all admitted at once: the rule must not cost throughput there);
- long prompts: 128 of 2,000-6,000 random token ids (make_workload, seed 0), 64-256 new tokens
  each, max_num_seqs 64 and 512 (the engine is built with max_model_len 8192 for them);
- Poisson arrivals at 4, 16 and 64 requests/s, max_num_seqs=512: the reference workload's first
  requests, at most 128 of them and at most about 8 s of arrivals (so 32 at 4 req/s).
Then issue 54's ITL rows, decode-first only: the reference workload at t=0 on a second engine,
built with max_num_seqs=64 as a user would build it (its graph ladder and prefill budget follow
from 64, where the runs above only lower the scheduler's limit), and the Poisson runs above.
Capped so that the section takes about 3 minutes for the Qwen3-0.6B shape on an H100.
`--quick` (a CPU): the quick workload, 8 long prompts of 60-200 tokens, max_num_seqs 4 for the
"64" runs, 10 and 40 req/s, and prefill budgets of 128 (32 while decoding) so that prompts chunk.

The step API hands out every request's whole completion each step: host work that `generate`
does not do. Compare tokens/s here rule against rule, and against `--run` with that in mind.

`drive` reaches the engine through a `Client`: `StepClient` is the step API in this process;
serving_http.py's `HttpClient` is the OpenAI-compatible server over HTTP (--serving-http: the
Poisson workloads both ways, so the HTTP layer's cost shows).
"""
import gc
import math
import random
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from itertools import accumulate
from typing import Callable, Hashable, Protocol

import numpy as np

from benchmarks.harness import Setup, report_leftover_memory
from nanograph.engine.scheduler import Scheduler
from benchmarks.report import cell, mib, ms, on_off, print_table
from benchmarks.timing import call_figures, counters, synchronize
from benchmarks.workloads import Workload, make_workload

# rule -> RuleScheduler.prefill_first; the new rule first (compare_rules pairs results in this
# order)
RULES = {"decode-first": False, "prefill-first": True}


class RuleScheduler(Scheduler):
    """The engine's scheduler, and with `prefill_first` the rule before mixed steps: a
    prefill-only step whenever a prompt can be admitted, else a decode-only step."""
    prefill_first = False

    def schedule(self):
        if not self.prefill_first:
            return super().schedule()
        if (prefills := self.schedule_prefills(self.max_num_batched_tokens)):
            return self.commit([], prefills)
        decodes = self.schedule_decodes()
        return self.commit(decodes, []) if decodes else None


# ---- what a client sees ------------------------------------------------------------------------

@dataclass
class LatencyTrace:
    """What a client saw, in seconds from `start` (a time.perf_counter() reading): when each
    request arrived, when each of its tokens came back and in which step (one `Client.step`
    call)."""
    start: float = field(default_factory=time.perf_counter)
    arrival: dict = field(default_factory=dict)        # request -> seconds
    token_times: dict = field(default_factory=dict)    # request -> seconds, one per token
    token_steps: dict = field(default_factory=dict)    # request -> step index, one per token
    step_intervals: list[float] = field(default_factory=list)  # between consecutive returns
    steps: int = 0
    seconds: float = 0.0              # wall time: the start to the last step's return
    last_return: float | None = None  # None after an idle wait: that interval is no step's

    def arrive(self, request: Hashable, at: float) -> None:
        self.arrival[request] = at
        self.token_times[request], self.token_steps[request] = [], []

    def stepped(self, at: float, totals: list[tuple]) -> None:
        """A step returned at `at` with `Client.step`'s entries: (request, its output tokens so
        far), or (request, its output tokens so far, the perf_counter() reading when they came);
        0 tokens so far: the request was sent then, its arrival from now on."""
        if self.last_return is not None:
            self.step_intervals.append(at - self.last_return)
        self.last_return = at
        for request, total, *came in totals:
            when = came[0] - self.start if came else at
            if total == 0:
                self.arrival[request] = when
                continue
            new = total - len(self.token_times[request])
            self.token_times[request] += [when] * new  # k at once: one gap, then k - 1 of zero
            self.token_steps[request] += [self.steps] * new
        self.steps += 1

    def idle(self) -> None:
        self.last_return = None

    @property
    def output_tokens(self) -> int:
        return sum(map(len, self.token_times.values()))

    def ttfts(self) -> list[float]:
        return [times[0] - self.arrival[r] for r, times in self.token_times.items() if times]

    @staticmethod
    def gaps(per_request: dict) -> list:
        """Differences between consecutive entries of each request's list."""
        return [b - a for values in per_request.values() for a, b in zip(values, values[1:])]


class Client(Protocol):
    """How `drive` reaches an engine."""

    def add(self, prompt: list[int], params) -> Hashable:
        """Send a request now; returns its key in the trace."""

    def step(self, timeout: float | None) -> list[tuple]:
        """Advance: (request, its output tokens so far) for each request that got tokens. A
        client that waits for tokens returns by `timeout` seconds (the next arrival is due). A
        client that knows when tokens came adds that time.perf_counter() reading to the entry,
        one entry per arrival, in order; else they count as come when `step` returns. A client
        that sends a request later than `add` (over a network, from its own thread) may say when
        with an entry of 0 tokens, before the request's first: its TTFT counts from then."""

    def busy(self) -> bool:
        """Whether a request sent is unfinished."""


@dataclass
class StepClient:
    """The engine step API in this process: a step is one `llm.step()`."""
    llm: object  # a nanograph LLM

    def add(self, prompt: list[int], params) -> int:
        return self.llm.add_request(prompt, params)

    def step(self, timeout: float | None = None) -> list[tuple[int, int]]:
        return [(out["request_id"], len(out["token_ids"])) for out in self.llm.step()]

    def busy(self) -> bool:
        return self.llm.has_unfinished_requests()


def drive(client: Client, workload: Workload, arrivals: list[float]) -> LatencyTrace:
    """Send each request once its arrival time (seconds from the start, in order) has passed;
    step while anything is unfinished; when nothing is, sleep until the next arrival."""
    pending = deque(zip(arrivals, workload.prompts, workload.sampling_params()))
    trace = LatencyTrace()
    start = trace.start
    while pending or client.busy():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            at, prompt, params = pending.popleft()
            trace.arrive(client.add(prompt, params), at)
        until_next = pending[0][0] - now if pending else None
        if client.busy():
            totals = client.step(until_next)
            trace.stepped(time.perf_counter() - start, totals)
        else:
            time.sleep(until_next)
            trace.idle()
    trace.seconds = time.perf_counter() - start
    return trace


# ---- the runs ----------------------------------------------------------------------------------

@dataclass
class ServingResult:
    """One workload under one rule: a row of the serving table. Times in seconds."""
    workload: str
    rule: str
    max_num_seqs: int
    requests: int
    output_tokens: int
    seconds: float
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    itl_max: float | None       # the longest gap between two tokens of a sequence
    gap_steps_max: int | None   # the same gap, counted in steps
    step_p50: float | None
    steps: dict                 # scheduled steps by kind: decode / mixed / prefill
    mixed_graph_hit_rate: float | None  # share of mixed steps replayed from a graph (CUDA)
    graph_hit_rate: float | None        # the same for decode steps

    @classmethod
    def of(cls, workload: str, rule: str, max_num_seqs: int, trace: LatencyTrace,
           figures: dict) -> "ServingResult":
        ttfts, itls = trace.ttfts(), trace.gaps(trace.token_times)
        gap_steps = trace.gaps(trace.token_steps)
        return cls(workload, rule, max_num_seqs, len(trace.arrival), trace.output_tokens,
                   trace.seconds, percentile(ttfts, 50), percentile(ttfts, 99),
                   percentile(itls, 50), percentile(itls, 99), max(itls, default=None),
                   max(gap_steps, default=None), percentile(trace.step_intervals, 50),
                   figures["steps"], figures.get("mixed_graph_hit_rate"),
                   figures.get("graph_hit_rate"))

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def itl_p99_vs_p50(self) -> float | None:
        return ratio(self.itl_p99, self.itl_p50)

    @property
    def itl_max_vs_p50(self) -> float | None:
        return ratio(self.itl_max, self.itl_p50)

    def to_dict(self) -> dict:
        return dict(asdict(self), tokens_per_s=self.tokens_per_s,
                    itl_p99_vs_p50=self.itl_p99_vs_p50, itl_max_vs_p50=self.itl_max_vs_p50)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class Target:
    """One of issue 43's or 45's targets for a workload, on an H100 (Qwen3-0.6B shape)."""
    text: str
    # (the result judged, the one it is judged against): (decode-first, prefill-first) here,
    # (HTTP, in process) in serving_http.py
    met: Callable[[ServingResult, ServingResult], bool]


TARGET_64 = Target("ITL p99 <= 1.5x p50 and <= 0.5x old's; tok/s >= 1.10x old's",
                   lambda new, old: new.itl_p99 <= 1.5 * new.itl_p50
                   and new.itl_p99 <= 0.5 * old.itl_p99
                   and new.tokens_per_s >= 1.10 * old.tokens_per_s)
TARGET_512 = Target("tok/s >= old's (and --run's >= 18,000)",
                    lambda new, old: new.tokens_per_s >= old.tokens_per_s)
TARGET_LONG = Target("longest gap <= 3x ITL p50", lambda new, old: new.itl_max <= 3 * new.itl_p50)
ITL_RATIO = 1.5  # issue 54: ITL p99 <= 1.5x p50 (H100, Qwen3-0.6B shape), decode-first rule
TARGET_ITL = Target(f"ITL p99 <= {ITL_RATIO}x p50 (issue 54)",
                    lambda new, old: new.itl_p99 <= ITL_RATIO * new.itl_p50)


@dataclass
class ServingRun:
    """One workload of the section: its requests, when each arrives, the batch limit."""
    name: str
    workload: Workload
    max_num_seqs: int
    arrivals: list[float]  # seconds from the start, in order; all 0: continuous admission
    target: Target | None = None
    streamed: bool = True  # over HTTP: False, one response a request (its TTFT, ITL unknown)

    def fits(self, max_model_len: int) -> bool:
        lengths = zip(self.workload.prompts, self.workload.max_tokens)
        return all(len(prompt) + n <= max_model_len for prompt, n in lengths)


@dataclass(frozen=True)
class Scale:
    """The section's sizes: FULL for a GPU, QUICK (--quick) for a CPU."""
    few_seqs: int               # max_num_seqs of the continuous-admission runs ("64")
    long_prompts: tuple         # make_workload's (num_seqs, input lengths, output lengths)
    rates: tuple[float, ...]    # Poisson request rates, requests/s
    max_requests: int           # a Poisson run sends at most this many requests ...
    arrival_seconds: float      # ... arriving over about this many seconds at most
    max_model_len: int          # the engine's, at least
    budgets: dict = field(default_factory=dict)  # the engine's token budgets, if not its own


FULL = Scale(64, (128, 2000, 6000, 64, 256), (4.0, 16.0, 64.0), 128, 8.0, 8192)
QUICK = Scale(4, (8, 60, 200, 4, 16), (10.0, 40.0), 8, 2.0, 256,
              dict(max_num_batched_tokens=128, max_num_mixed_tokens=32))


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return list(accumulate(rng.expovariate(rate) for _ in range(n)))


def serving_runs(setup: Setup, scale: Scale) -> list[ServingRun]:
    reference, few = setup.workload, scale.few_seqs
    long = make_workload(*scale.long_prompts, max_token_id=setup.max_token_id)
    at_once = [0.0] * reference.num_seqs
    return [ServingRun(f"reference, {few} seqs", reference, few, at_once, TARGET_64),
            ServingRun("reference, 512 seqs", reference, 512, at_once, TARGET_512),
            ServingRun(f"long prompts, {few} seqs", long, few, [0.0] * long.num_seqs),
            ServingRun("long prompts, 512 seqs", long, 512, [0.0] * long.num_seqs, TARGET_LONG),
            *poisson_runs(setup, scale)]


def poisson_runs(setup: Setup, scale: Scale) -> list[ServingRun]:
    """The reference workload's first requests, arriving at each of the scale's rates."""
    reference, runs = setup.workload, []
    for rate in scale.rates:
        n = min(scale.max_requests, reference.num_seqs, math.ceil(rate * scale.arrival_seconds))
        runs.append(ServingRun(f"Poisson {rate:g} req/s, {n} requests", reference.head(n), 512,
                               poisson_arrivals(n, rate), TARGET_ITL if rate == 64 else None))
    return runs


def warmup_run(setup: Setup, max_num_seqs: int = 512) -> ServingRun:
    return ServingRun("warm-up", setup.warmup, max_num_seqs, [0.0] * setup.warmup.num_seqs)


def serving_knobs(setup: Setup, scale: Scale) -> dict:
    """The section's engine, as `Setup.llm`'s overrides: graphs up to 512 sequences, no prefix
    caching, room for the long prompts."""
    return dict(max_num_seqs=512, enable_prefix_caching=False,
                max_model_len=max(setup.args.max_model_len, scale.max_model_len), **scale.budgets)


def serving_engine(setup: Setup, scale: Scale, knobs: dict | None = None):
    llm = setup.llm(**(knobs or serving_knobs(setup, scale)))
    llm.scheduler.__class__ = RuleScheduler  # the same scheduler, with the rule switch
    return llm


def run_rule(llm, setup: Setup, run: ServingRun, rule: str) -> ServingResult:
    """One workload under one rule on `llm`: drive it through the step API, take the engine's
    counters around it."""
    llm.scheduler.max_num_seqs = run.max_num_seqs
    llm.scheduler.prefill_first = RULES[rule]
    gc.collect()  # not in the middle of a run
    synchronize(setup.device)
    before = counters(llm)
    trace = drive(StepClient(llm), run.workload, run.arrivals)
    synchronize(setup.device)
    figures = call_figures(before, counters(llm))
    return ServingResult.of(run.name, rule, run.max_num_seqs, trace, figures)


def engine_figures(llm) -> dict:
    config, stats = llm.config, llm.stats()
    return {"max_model_len": config.max_model_len,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "max_num_mixed_tokens": config.max_num_mixed_tokens,
            "overlap_scheduling": config.overlap_scheduling,
            "num_kvcache_blocks": stats["num_kvcache_blocks"],
            **{key: stats.get(key) for key in ("num_graphs", "mixed_graph_grid", "capture_seconds",
                                               "graph_memory_bytes")}}


def print_engine(engine: dict) -> None:
    graphs = "no CUDA graphs on this device"
    if engine["num_graphs"] is not None:
        graphs = (f"{engine['num_graphs']} CUDA graphs ({len(engine['mixed_graph_grid'])} mixed) "
                  f"captured in {engine['capture_seconds']:.1f} s, "
                  f"{mib(engine['graph_memory_bytes'])} MiB (targets: <= 15 s, <= 2 GiB)")
    print(f"\nServing engine: max_num_seqs 512, max_model_len {engine['max_model_len']}, prefill "
          f"budget {engine['max_num_batched_tokens']} ({engine['max_num_mixed_tokens']} x the "
          f"free seats' share while decoding), {engine['num_kvcache_blocks']} KV blocks, prefix "
          f"caching off, overlap {on_off(engine['overlap_scheduling'])}; {graphs}")


def print_results(results: list[ServingResult]) -> None:
    print_table("Serving through the step API, each workload under both rules on one engine "
                "(same prompts, lengths, arrivals); ms; ITL = time between two tokens of a "
                "request when step() returns them, max = the longest gap",
                ["workload", "rule", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99",
                 "ITL max", "p99/p50", "max/p50", "max gap (steps)", "step p50",
                 "steps d/m/p", "mixed graphs"],
                [[r.workload, r.rule, f"{r.tokens_per_s:,.0f}",
                  cell(ms(r.ttft_p50), ".1f"), cell(ms(r.ttft_p99), ".1f"),
                  cell(ms(r.itl_p50), ".2f"), cell(ms(r.itl_p99), ".2f"),
                  cell(ms(r.itl_max), ".1f"),
                  cell(r.itl_p99_vs_p50, ".2f", "x"), cell(r.itl_max_vs_p50, ".1f", "x"),
                  cell(r.gap_steps_max, "d"), cell(ms(r.step_p50), ".2f"),
                  "/".join(str(r.steps[kind]) for kind in ("decode", "mixed", "prefill")),
                  cell(r.mixed_graph_hit_rate, ".1%")] for r in results])


def compare_rules(runs: list[ServingRun], results: list[ServingResult], judge: bool) -> list:
    """new/old ratios of each workload, and its target: met or not where `judge`."""
    rows = []
    for run, new, old in zip(runs, results[::2], results[1::2]):
        met = run.target.met(new, old) if run.target and judge else None
        rows.append({"workload": run.name,
                     "tokens_per_s": ratio(new.tokens_per_s, old.tokens_per_s),
                     "ttft_p99": ratio(new.ttft_p99, old.ttft_p99),
                     "itl_p99": ratio(new.itl_p99, old.itl_p99),
                     "itl_max": ratio(new.itl_max, old.itl_max),
                     "target": run.target.text if run.target else None, "met": met})
    print_table("Decode-first over prefill-first, same workload (targets: issues 43 and 54, on "
                "an H100, Qwen3-0.6B shape; judged on full runs on CUDA only)",
                ["workload", "tok/s new/old", "TTFT p99 new/old", "ITL p99 new/old",
                 "longest gap new/old", "target", "met"],
                [[r["workload"], *(cell(r[key], ".3f", "x")
                                   for key in ("tokens_per_s", "ttft_p99", "itl_p99", "itl_max")),
                  r["target"] or "-", "-" if r["met"] is None else "yes" if r["met"] else "NO"]
                 for r in rows])
    return rows


def built_with_few_seats(setup: Setup, scale: Scale) -> ServingResult:
    """The reference workload, all at t=0, on an engine built with max_num_seqs=few_seqs as a
    user would build it (so its graphs and prefill budgets follow from that number), not on the
    section's 512-seat engine with the scheduler's limit lowered."""
    knobs = serving_knobs(setup, scale) | dict(max_num_seqs=scale.few_seqs)
    llm = serving_engine(setup, scale, knobs)
    try:
        run_rule(llm, setup, warmup_run(setup, scale.few_seqs), "decode-first")
        run = ServingRun(f"reference, engine of {scale.few_seqs} seats", setup.workload,
                         scale.few_seqs, [0.0] * setup.workload.num_seqs)
        return run_rule(llm, setup, run, "decode-first")
    finally:
        llm.close()
        del llm
        report_leftover_memory("the engine of few seats")


def print_itl_targets(few_seats: ServingResult, runs: list[ServingRun],
                      results: list[ServingResult], judge: bool):
    """Issue 54's ITL rows: the engine built with few seats, and the Poisson runs of the
    section's engine (512 seats, the default) under the decode-first rule; judged where the
    run has the target (the others reported)."""
    targeted = {run.name for run in runs if run.target is TARGET_ITL}
    poisson = [r for r in results if r.workload.startswith("Poisson") and r.rule == "decode-first"]
    rows = []
    for result in [few_seats, *poisson]:
        judged = judge and (result is few_seats or result.workload in targeted)
        rows.append([result.workload, result.max_num_seqs, f"{result.tokens_per_s:,.0f}",
                     cell(ms(result.itl_p50), ".2f"), cell(ms(result.itl_p99), ".2f"),
                     cell(result.itl_p99_vs_p50, ".2f", "x"),
                     ("met" if TARGET_ITL.met(result, None) else "MISSED") if judged else "-"])
    print_table(f"ITL under the decode-first rule (target: issue 54, p99 <= {ITL_RATIO}x p50 on "
                "an H100, on the engine of few seats and at the highest Poisson rate; the others "
                "reported); ms",
                ["workload", "seats", "tok/s", "ITL p50", "ITL p99", "p99/p50", "target"], rows)


def section_serving(setup: Setup) -> dict:
    scale = QUICK if setup.args.quick else FULL
    runs = serving_runs(setup, scale)
    print(f"  [serving] building the engine, warming up, {len(runs)} workloads x "
          f"{len(RULES)} rules ...", flush=True)
    llm = serving_engine(setup, scale)
    try:
        engine = engine_figures(llm)
        skipped = [run.name for run in runs if not run.fits(llm.config.max_model_len)]
        runs = [run for run in runs if run.name not in skipped]
        for rule in RULES:
            run_rule(llm, setup, warmup_run(setup), rule)
        results = [run_rule(llm, setup, run, rule) for run in runs for rule in RULES]
        sweep = budget_sweep(llm, setup, runs, results)
    finally:
        llm.close()
        del llm
        report_leftover_memory("the serving engine")
    few_seats = built_with_few_seats(setup, scale)
    print_engine(engine)
    if skipped:
        print(f"  skipped (longer than max_model_len {engine['max_model_len']}): "
              f"{', '.join(skipped)}")
    print_results(results)
    judge = engine["num_graphs"] is not None and not setup.args.quick
    ratios = compare_rules(runs, results, judge)
    if sweep:
        print_budget_sweep(sweep, judge)
    print_itl_targets(few_seats, runs, results, judge)
    return {"engine": engine,
            "engine_of_few_seats": few_seats.to_dict(),
            "skipped": skipped,
            "runs": [r.to_dict() for r in results],
            "ratios": ratios,
            "budget_sweep": [(budget, new.to_dict()) for budget, new, _, _ in sweep]}


def budget_sweep(llm, setup: Setup, runs: list[ServingRun], results: list[ServingResult]) -> list:
    """`--mixed-budgets`: the workloads with a target again under the decode-first rule, once per
    `max_num_mixed_tokens` (the prefill budget of a step while sequences decode, times the free
    seats' share; set on the scheduler: the engine's mixed graphs cover every smaller budget),
    each against the prefill-first result of the same workload above. (budget, new result, old
    result, target) rows."""
    default = llm.scheduler.max_num_mixed_tokens
    sweep = []
    try:
        for budget in setup.args.mixed_budgets or ():
            llm.scheduler.max_num_mixed_tokens = budget
            for run, old in zip(runs, results[1::2]):
                if run.target is not None:
                    new = run_rule(llm, setup, run, "decode-first")
                    sweep.append((budget, new, old, run.target))
    finally:
        llm.scheduler.max_num_mixed_tokens = default
    return sweep


def print_budget_sweep(sweep: list, judge: bool):
    print_table("Decode-first by prefill budget while decoding (max_num_mixed_tokens), against "
                "prefill-first on the same workload; ms",
                ["budget", "workload", "tok/s", "new/old", "ITL p50", "ITL p99", "p99/p50",
                 "ITL max", "max/p50", "ITL p99 new/old", "mixed graphs", "target met"],
                [[budget, new.workload, f"{new.tokens_per_s:,.0f}",
                  cell(ratio(new.tokens_per_s, old.tokens_per_s), ".3f", "x"),
                  cell(ms(new.itl_p50), ".2f"), cell(ms(new.itl_p99), ".2f"),
                  cell(new.itl_p99_vs_p50, ".2f", "x"), cell(ms(new.itl_max), ".1f"),
                  cell(new.itl_max_vs_p50, ".1f", "x"),
                  cell(ratio(new.itl_p99, old.itl_p99), ".3f", "x"),
                  cell(new.mixed_graph_hit_rate, ".1%"),
                  "-" if not judge else "yes" if target.met(new, old) else "NO"]
                 for budget, new, old, target in sweep])
