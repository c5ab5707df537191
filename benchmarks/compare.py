"""--compare: the reference workload on nanograph with graphs, nanograph eager, HF transformers
and the peers, one after the other in this process, each a row of one table.

Every engine gets the same prompts (token ids) and the same per-request output lengths, with EOS
disabled, so the work is fixed by the workload; every engine builds the same public shape from
the same config.json, in the same dtype (shapes.py); only the generate call is timed, after a
warm-up (harness.py). Each engine is freed before the next one is built: nanograph eager
(`enforce_eager=True`) on a fresh engine, HF in this process (hf.py), the peers in subprocesses
(peers.py) on the random weights written once as a checkpoint (checkpoint.py).

HF runs only the first `--hf-seqs` sequences, and its throughput grows with the number of
concurrent requests, so nanograph with graphs runs those same sequences too, on an engine of its
own (no prefix-cache hits from the full run): each ratio in the table is between two runs of the
same sequences (`same_set_ratios`).
"""
from benchmarks import checkpoint, peers
from benchmarks.harness import Setup, run_nanograph
from benchmarks.hf import run_hf
from benchmarks.report import RunResult, cell, print_table


def same_set_ratios(rows: list[RunResult]) -> list[float | None]:
    """Each row's tok/s over that of the first row that ran the same number of (leading)
    sequences: nanograph's with graphs, which comes first in each set."""
    base = {}
    for r in rows:
        base.setdefault(r.num_seqs, r.tokens_per_s)
    return [r.tokens_per_s / base[r.num_seqs] if base[r.num_seqs] and not r.error else None
            for r in rows]


def note_cell(r: RunResult) -> str:
    if not r.error:
        return r.note
    return r.error if r.error.startswith("skipped") else f"ERROR {r.error}"


def section_compare(setup: Setup, graphs: RunResult) -> list[RunResult]:
    """`graphs` is the reference run (run.py); the other rows are run here."""
    workload = setup.workload
    rows = [graphs, run_nanograph(setup, "nanograph (eager)", workload, enforce_eager=True)]
    subset = workload.head(setup.args.hf_seqs)
    if 0 < subset.num_seqs < workload.num_seqs:  # HF's sequences, on nanograph too
        label = f"{graphs.engine}, first {subset.num_seqs} sequences"
        rows.append(run_nanograph(setup, label, subset))
    rows.append(run_hf(setup, workload))
    if setup.load_format == "dummy":  # written once, for every peer
        weights = checkpoint.write_checkpoint(setup)
    else:
        weights = setup.model_dir
    rows += [peers.run_peer(setup, peer, weights) for peer in peers.PEERS]
    for r, ratio in zip(rows, same_set_ratios(rows)):
        r.vs_nanograph = ratio
    print_table("Throughput (tok/s = output tokens / generate wall time); each ratio is against "
                "nanograph with graphs on the same sequences",
                ["engine", "seqs", "output tokens", "seconds", "tok/s", "vs nanograph", "note"],
                [[r.engine,
                  r.num_seqs,
                  f"{r.output_tokens:,}",
                  f"{r.seconds:.2f}",
                  f"{r.tokens_per_s:,.0f}" if not r.error else "-",
                  cell(r.vs_nanograph, ".3f", "x"),
                  note_cell(r)] for r in rows])
    return rows
