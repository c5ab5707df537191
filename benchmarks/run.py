"""The reference run: the workload through nanograph's `generate`, and that call's graph figures.

Throughput = output tokens / wall time of one `generate` call (harness.py: after a warm-up,
nothing else on the clock). The graph figures (hit rate, padding waste, replays per bucket) are
those of the timed call alone: the graph runner's counters after it minus before it. With
`--overlap` the same engine is probed afterwards (overlap.py), so it serves as that table's row
for the mode it defaults to.
"""
from benchmarks.harness import Setup, run_nanograph
from benchmarks.overlap import overlap_probe
from benchmarks.report import RunResult, mib, on_off
from benchmarks.timing import is_cuda
from benchmarks.workloads import Workload


def print_run(result: RunResult, workload: Workload) -> None:
    s = result.stats
    print(f"\n{result.engine}: {workload.num_seqs} sequences, "
          f"{workload.prompt_tokens:,} prompt tokens")
    print(f"  output tokens {result.output_tokens:,} (requested {workload.output_tokens:,})"
          f"   time {result.seconds:.2f} s   throughput {result.tokens_per_s:,.0f} tok/s"
          f"   overlap scheduling {on_off(s.get('overlap_scheduling'))}")
    if "graph_hit_rate" in s:
        print(f"  graphs {s.get('num_graphs', 0)} {s.get('cuda_graph_sizes', [])}")
        print(f"  capture {s.get('capture_seconds', 0):.2f} s"
              f"   graph memory {mib(s.get('graph_memory_bytes', 0))} MiB")
        print(f"  this call: decode steps {s['decode_steps']}   hit rate {s['graph_hit_rate']:.1%}"
              f"   padding waste {s['padding_waste']:.1%}"
              f"   replays per bucket {s['replays_per_bucket']}")
    else:
        print("  no CUDA graphs on this device")
    discarded = ""
    if "overlap_discarded_tokens" in s:
        discarded = f"   overlap discarded tokens {s['overlap_discarded_tokens']}"
    print(f"  KV blocks {s.get('num_kvcache_blocks')}   preemptions {s.get('preemptions')}"
          f"   prefix-cache hit tokens {s.get('prefix_cache_hit_tokens')}{discarded}"
          f"   attention {s.get('attention_backend')}")


def section_run(setup: Setup) -> RunResult:
    label = "nanograph (CUDA graphs)" if is_cuda(setup.device) else "nanograph (CPU, no graphs)"
    probe = overlap_probe if setup.args.overlap else None
    result = run_nanograph(setup, label, setup.workload, probe=probe)
    print_run(result, setup.workload)
    return result
