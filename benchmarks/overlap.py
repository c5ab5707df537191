"""Overlap scheduling (`LLM(overlap_scheduling=...)`) on and off, side by side.

Both modes run the same workload, each on an engine of its own: the reference run's engine
serves the mode it defaults to (on with CUDA), the other mode gets a new one. After its timed
call each engine is probed (`overlap_probe`): batch-1 ms per generated token through `generate`
(at the workload's temperature 0.6, and greedy), the graph step alone at batch 1 for scale, and
on CUDA how busy the GPU was in decode-heavy calls: the union of its kernel and copy intervals
under torch.profiler over the span from the first to the last. The profiler slows the host, so
those are calls of their own, after the timed ones.
"""
import random

from benchmarks.harness import Setup, per_token_latency, run_nanograph
from benchmarks.report import RunResult, cell, ms, on_off, print_table
from benchmarks.runner import decode_step, time_forward
from benchmarks.timing import gpu_busy_share, is_cuda


def overlap_probe(llm, setup: Setup) -> dict:
    """After the timed call, on the same engine: batch-1 ms per generated token, the graph step
    at batch 1, and (CUDA) the GPU's busy share in two decode-heavy profiled calls: one sequence,
    and the workload's sequences with their prompts cut to 16 tokens (one prefill step)."""
    args, runner = setup.args, llm.runner
    prompt_len, new_tokens = args.latency_lengths
    probe = {
        "ms_per_token": ms(per_token_latency(llm, setup, prompt_len, new_tokens, seed=2)),
        "greedy_ms_per_token": ms(per_token_latency(llm, setup, prompt_len, new_tokens, seed=5,
                                                    temperature=0)),
    }
    if is_cuda(setup.device):
        prompt = [random.Random(4).randint(0, setup.max_token_id) for _ in range(prompt_len)]
        cut_prompts = [p[:16] for p in setup.workload.prompts]
        probe["gpu_busy_batch1"] = gpu_busy_share(llm, [prompt], new_tokens)
        probe["gpu_busy_workload"] = gpu_busy_share(llm, cut_prompts, new_tokens // 2)
    if runner.graphs is not None:  # last: it writes K/V into blocks it does not own
        step = decode_step(1, args.sweep_context_len, runner.block_size)
        probe["graph_step_ms"] = ms(time_forward(runner, step, setup.device, args.sweep_iters))
        for key in ("ms_per_token", "greedy_ms_per_token"):
            ratio = probe[key] / probe["graph_step_ms"] if probe[key] else None
            probe[key.replace("ms_per_token", "vs_step")] = ratio
    return probe


def section_overlap(setup: Setup, run: RunResult) -> list[RunResult]:
    """Overlap scheduling on and off: `run` is one of the two, the other gets an engine here."""
    other = not run.stats["overlap_scheduling"]
    rows = [run, run_nanograph(setup, f"nanograph, overlap {on_off(other)}", setup.workload,
                               probe=overlap_probe, overlap_scheduling=other)]
    rows.sort(key=lambda r: not r.stats["overlap_scheduling"])  # on first
    (prompt_len, new_tokens), n = setup.args.latency_lengths, setup.workload.num_seqs
    print_table("Overlap scheduling, same workload; batch 1: ms per generated token through "
                "generate (temperature 0.6, and greedy), and the graph step alone",
                ["overlap", "tok/s", "batch-1 ms/token", "greedy ms/token", "graph step b1 ms",
                 "ms/token / step", "greedy / step", "GPU busy, 1 seq", f"GPU busy, {n} seqs",
                 "discarded tokens"],
                [[on_off(r.stats["overlap_scheduling"]),
                  f"{r.tokens_per_s:,.0f}",
                  cell(r.probe["ms_per_token"]),
                  cell(r.probe["greedy_ms_per_token"]),
                  cell(r.probe.get("graph_step_ms")),
                  cell(r.probe.get("vs_step"), ".2f", "x"),
                  cell(r.probe.get("greedy_vs_step"), ".2f", "x"),
                  cell(r.probe.get("gpu_busy_batch1"), ".1%"),
                  cell(r.probe.get("gpu_busy_workload"), ".1%"),
                  r.stats.get("overlap_discarded_tokens", "-")] for r in rows])
    if is_cuda(setup.device):
        print(f"  GPU busy: union of kernel and copy intervals / span from the first to the last, "
              f"under torch.profiler, in calls after the timed ones (the profiler slows the host): "
              f"1 sequence (prompt {prompt_len}, {new_tokens} new tokens), and the workload's {n} "
              f"with prompts cut to 16 tokens, {new_tokens // 2} new")
    else:
        print("  (CPU: no graph step and no GPU to profile: busy shares skipped)")
    return rows
