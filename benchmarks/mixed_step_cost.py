"""--mixed-step-cost: a mixed step's cost next to a decode step, by the prefill tokens beside it.

The scheduler's prefill budget for a mixed step (engine/scheduler.py) trades the gap between two
tokens of every decoding sequence against how fast prompts get in; this measures the price side.

The engine. Overlap scheduling off, so that a step's time is its own (launch, replay, the sampled
ids back); prefix caching off. `decodes` sequences of `context` random prompt tokens are added
and prefilled with the whole prefill budget a step (a few prefill-heavy steps; under the
engine's free-seat rule the last prompts would go in a small chunk a step while the first ones
decode towards their max_tokens), so that all of them decode from then on, far from their end.
max_num_seqs is decodes + 1 (one seat for the prompt a row prefills) and the decode graphs end
at `decodes` rows (cuda_graph_max_bs): the decode-only row and the mixed rows then put their
decode rows in a bucket of exactly `decodes`. (With the default ladder, which ends at
max_num_seqs, a decode-only step of 64 rows would replay the 65-row graph and a mixed step the
64-row one.)

The rows, one after the other on that engine:
- decode step only: the `decodes` sequences, nothing else;
- + N prefill tokens: a new prompt is added and prefilled N tokens a step beside them (the
  budget fixed at N by `FixedBudgetScheduler`); it is one token longer than the row prefills,
  so it never becomes a decode row, and it is aborted after the row.
Each row runs WARMUP untimed steps (a graph's first replays cost more), then `steps` steps
timed one by one (wall time of `LLM.step()`): p50, mean, and p50 over the decode-only row's p50.
What each row's steps were is measured, not assumed: the scheduler logs every step it makes
(kind, decode rows, prefill tokens) and the graph counters say what each replayed (timing.py:
"64+64" is 64 decode rows and 64 prefill tokens, the smallest prefill bucket, which a 16-token
chunk pads to); a row whose steps are not what it claims is marked (`as_claimed`). The
decoding sequences' context grows a token a step, (WARMUP + steps) a row. Issue 54's target
(TARGET_*) is judged on the 16-token row of a full run on CUDA. tools/mixed_step_cost.py runs
the same measurement from the command line.
"""
import gc
import random
import statistics
import time
from dataclasses import dataclass

from benchmarks.harness import Setup, report_leftover_memory
from benchmarks.report import cell, print_table
from benchmarks.timing import call_figures, counters, is_cuda
from nanograph import SamplingParams
from nanograph.engine.scheduler import Scheduler

WARMUP = 2  # untimed steps before each row's timed ones
TARGET_DECODES, TARGET_TOKENS, TARGET_RATIO = 64, 16, 1.10  # issue 54, on an H100


class FixedBudgetScheduler(Scheduler):
    """The engine's scheduler with a mixed step's prefill part fixed at `budget` tokens (None:
    the engine's rule), logging (kind, decode rows, prefill tokens) of every step it makes."""
    budget: int | None = None

    def prefill_budget(self, num_decodes: int) -> int:
        return super().prefill_budget(num_decodes) if self.budget is None else self.budget

    def commit(self, decodes, prefills):
        batch = super().commit(decodes, prefills)
        self.log.append((batch.kind, batch.num_decodes, sum(batch.num_tokens[batch.num_decodes:])))
        return batch


@dataclass(frozen=True)
class Scale:
    """The section's sizes: FULL for a GPU, QUICK (--quick) for a CPU."""
    decodes: int                     # sequences decoding
    context: int                     # their prompt tokens
    prefill_tokens: tuple[int, ...]  # a row for each: prefill tokens a step beside them
    steps: int                       # timed steps a row

    @property
    def new_tokens(self) -> int:
        """The decoding sequences' max_tokens: room for the prefill steps (at most one a prompt,
        while a prompt fits the budget) and every row's."""
        return self.decodes + 2 + (len(self.prefill_tokens) + 1) * (WARMUP + self.steps)

    def prompt_len(self, tokens: int) -> int:
        return (WARMUP + self.steps) * tokens + 1

    def engine_knobs(self) -> dict:
        longest = max(self.context + self.new_tokens, self.prompt_len(max(self.prefill_tokens)) + 1)
        return dict(max_num_seqs=self.decodes + 1, cuda_graph_max_bs=self.decodes,
                    overlap_scheduling=False, enable_prefix_caching=False, max_model_len=longest)


FULL = Scale(64, 1000, (16, 64, 128, 256, 512), 16)
QUICK = Scale(4, 32, (8, 16), 4)


def graphs_used(before: dict, after: dict) -> dict:
    """{graph: replays} of the steps between two `counters` snapshots: "64" a decode graph of 64
    rows, "64+128" a mixed graph of 64 decode rows and 128 prefill tokens, "eager" no graph."""
    if "replays" not in after:
        return {"eager": sum(after["steps"].values()) - sum(before["steps"].values())}
    used = {(f"{shape.decodes}+{shape.prefill_tokens}" if shape.prefill_tokens
             else f"{shape.decodes}"): n
            for shape, n in (after["replays"] - before["replays"]).items()}
    eager = (after["eager"] - before["eager"]).total()
    return used | ({"eager": eager} if eager else {})


def timed_row(llm, scale: Scale, tokens: int) -> dict:
    """The row of `tokens` prefill tokens a step (0: decode only), on `llm` set up by fill()."""
    scheduler = llm.scheduler
    for _ in range(WARMUP):
        llm.step()
    gc.collect()  # not in the middle of the row
    scheduler.log = []
    before, seconds = counters(llm), []
    for _ in range(scale.steps):
        start = time.perf_counter()
        llm.step()  # overlap off: returns with the step's sampled ids
        seconds.append(time.perf_counter() - start)
    after = counters(llm)
    figures = call_figures(before, after)
    kind = "mixed" if tokens else "decode"
    return {"prefill_tokens": tokens,
            "ms_p50": statistics.median(seconds) * 1e3,
            "ms_mean": statistics.fmean(seconds) * 1e3,
            "steps": figures["steps"],
            "decode_rows": sorted({rows for _, rows, _ in scheduler.log}),
            "prefill_tokens_a_step": sorted({chunk for _, _, chunk in scheduler.log}),
            "graphs": graphs_used(before, after),
            "preemptions": figures["preemptions"],
            "as_claimed": len(scheduler.log) == scale.steps
            and all(step == (kind, scale.decodes, tokens) for step in scheduler.log)}


def fill(llm, scale: Scale, rng: random.Random, max_token_id: int) -> None:
    """`decodes` sequences of `context` prompt tokens, prefilled with the whole budget a step."""
    llm.scheduler.__class__ = FixedBudgetScheduler
    # every step within max_num_batched_tokens, the largest the engine sized its memory for
    llm.scheduler.log = []
    llm.scheduler.budget = llm.config.max_num_batched_tokens - scale.decodes
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=scale.new_tokens)
    for _ in range(scale.decodes):
        llm.add_request([rng.randint(0, max_token_id) for _ in range(scale.context)], params)
    while llm.scheduler.waiting:
        llm.step()


def measure_mixed_steps(llm, scale: Scale, max_token_id: int, judge: bool) -> list[dict]:
    """Every row on `llm`, built with `scale.engine_knobs()`; the target judged where `judge`."""
    rng = random.Random(0)
    fill(llm, scale, rng, max_token_id)
    rows = [timed_row(llm, scale, 0)]
    for tokens in scale.prefill_tokens:
        llm.scheduler.budget = tokens
        prompt = [rng.randint(0, max_token_id) for _ in range(scale.prompt_len(tokens))]
        request = llm.add_request(prompt, SamplingParams(max_tokens=1))
        rows.append(timed_row(llm, scale, tokens))
        llm.abort_request(request)
    for row in rows:
        row["vs_decode_only"] = row["ms_p50"] / rows[0]["ms_p50"]
        row["target"] = target_cell(row, scale.decodes, judge) or None
    return rows


def target_cell(row: dict, decodes: int, judge: bool) -> str:
    if (decodes, row["prefill_tokens"]) != (TARGET_DECODES, TARGET_TOKENS):
        return ""
    verdict = ("met" if row["vs_decode_only"] <= TARGET_RATIO else "MISSED") if judge else "-"
    return f"<= {TARGET_RATIO:.2f}x: {verdict}"


def print_rows(rows: list[dict], scale: Scale, config) -> None:
    block_size = config.kvcache_block_size
    print_table(f"A step of {scale.decodes} sequences decoding at context {scale.context:,} and "
                f"up (a token a step), alone and beside prefill tokens, "
                f"through LLM.step() (overlap off; max_num_seqs {config.max_num_seqs}, "
                f"cuda_graph_max_bs {config.cuda_graph_max_bs}, max_model_len "
                f"{config.max_model_len:,}: block tables of "
                f"{-(-config.max_model_len // block_size)} x {block_size} tokens); "
                f"{scale.steps} timed steps a row after {WARMUP}; target: issue 54, on an H100",
                ["row", "ms p50", "ms mean", "x decode-only", "steps d/m/p", "decode rows",
                 "prefill a step", "graphs (replays)", "as claimed", "target"],
                [["decode step only" if not r["prefill_tokens"] else
                  f"+ {r['prefill_tokens']} prefill tokens",
                  cell(r["ms_p50"], ".2f"), cell(r["ms_mean"], ".2f"),
                  cell(r["vs_decode_only"], ".2f", "x"),
                  "/".join(str(r["steps"][kind]) for kind in ("decode", "mixed", "prefill")),
                  ",".join(map(str, r["decode_rows"])),
                  ",".join(map(str, r["prefill_tokens_a_step"])),
                  " ".join(f"{graph}:{n}" for graph, n in r["graphs"].items()),
                  "yes" if r["as_claimed"] else "NO", r["target"] or ""] for r in rows])


def section_mixed_step_cost(setup: Setup) -> dict:
    scale = QUICK if setup.args.quick else FULL
    print(f"  [mixed step cost] {scale.decodes} sequences at context {scale.context}, prefill "
          f"tokens {list(scale.prefill_tokens)} ...", flush=True)
    judge = is_cuda(setup.device) and not setup.args.quick
    with setup.llm(**scale.engine_knobs()) as llm:
        rows = measure_mixed_steps(llm, scale, setup.max_token_id, judge)
        config = llm.config
    report_leftover_memory("the mixed-step engine")
    print_rows(rows, scale, config)
    return {"decodes": scale.decodes, "context": scale.context, "steps": scale.steps,
            "warmup_steps": WARMUP, "max_model_len": config.max_model_len, "rows": rows}
