"""--ladders: the reference workload once per bucket ladder, each on an engine of its own.

A ladder is the set of batch sizes the engine captures a decode graph for (cuda_graph.py): a
decode batch replays the smallest graph that holds it, padded. `default` is the engine's own rule;
`pow2` (1, 2, 4, ..., 512) and `nano-vllm` (1, 2, 4, 8, then every 16 up to 512) are built here
and passed as `cuda_graph_sizes`. The rows differ only in the ladder: graphs captured, capture
time, graph memory, and for the timed call its hit rate, padding waste and throughput.
"""
from benchmarks.harness import Setup, run_nanograph
from benchmarks.report import RunResult, mib, print_table
from benchmarks.timing import is_cuda

LADDER_POLICIES = ("default", "pow2", "nano-vllm")
LADDER_MAX_BS = 512  # the engine's largest graph batch here: min(max_num_seqs = 512, 512)


def ladder_sizes(policy: str, max_bs: int) -> list[int] | None:
    """The `cuda_graph_sizes` of a --ladders policy; None: the engine's own rule
    (nanograph.engine.cuda_graph.bucket_ladder). Every ladder ends at max_bs."""
    if policy == "pow2":
        return sorted({1 << i for i in range(max_bs.bit_length())} | {max_bs})
    if policy == "nano-vllm":
        small = {s for s in (1, 2, 4, 8) if s < max_bs}
        return sorted(small | set(range(16, max_bs, 16)) | {max_bs})
    return None


def print_ladders(rows: list[RunResult]) -> None:
    print_table("Bucket ladders, same workload (graph figures of the timed call)",
                ["ladder", "graphs", "capture s", "graph MiB", "hit rate", "padding", "tok/s",
                 "sizes"],
                [[r.engine,
                  r.stats.get("num_graphs"),
                  f"{r.stats.get('capture_seconds', 0):.2f}",
                  mib(r.stats.get("graph_memory_bytes", 0)),
                  f"{r.stats.get('graph_hit_rate', 0):.1%}",
                  f"{r.stats.get('padding_waste', 0):.1%}",
                  f"{r.tokens_per_s:,.0f}",
                  r.stats.get("cuda_graph_sizes")] for r in rows])


def section_ladders(setup: Setup) -> dict:
    if not is_cuda(setup.device):
        print("\n(ladders skipped: bucket ladders are CUDA graphs, and there are none on the CPU)")
        return {"skipped": "no CUDA graphs on the CPU"}
    rows = []
    for policy in LADDER_POLICIES:
        print(f"  ladder {policy} ...", flush=True)
        sizes = ladder_sizes(policy, LADDER_MAX_BS)
        rows.append(run_nanograph(setup, policy, setup.workload, cuda_graph_sizes=sizes))
    print_ladders(rows)
    return {"rows": [r.to_dict() for r in rows]}
