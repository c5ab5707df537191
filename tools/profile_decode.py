"""Where a decode step's time goes: replay one captured graph under torch.profiler.

    python -m tools.profile_decode [--shape qwen3-0.6b] [--batch 1] [--context 512]

Prints the kernels of one replay of a bench shape (bench.py --shape; dummy weights, bf16), grouped
by name, with their count, their GPU time ("busy") and their share of the step's critical path
("on path"), and then one layer's kernels in order.

Why two columns. With programmatic dependent launch (kernels/pdl.py) a kernel starts before the
previous one ends and waits inside, so its busy time includes that wait and the busy times add up
to more than the step. The critical path is what the step's length is made of: walking the
kernels in start order, each one is charged the time by which it pushes the latest end so far
further out (its end minus the latest earlier end, or 0). Those charges add up to the replay's
span exactly, so they say which kernels to make shorter: a GEMV whose weights were loaded while
attention ran is charged only for its tail after the wait.
"""
import argparse
import json
import tempfile
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.runner import decode_engine_args, decode_step, paced_run
from benchmarks.shapes import BENCH_SHAPES, SHAPES, write_model_dir
from nanograph import LLM

REPLAYS = 10


def replays(trace_path: str) -> list[list[dict]]:
    """The kernel events of the trace, in start order, cut into replays (a gap over 50 us)."""
    events = sorted((e for e in json.load(open(trace_path))["traceEvents"] if e.get("cat") == "kernel"),
                    key=lambda e: e["ts"])
    runs = [[events[0]]]
    for before, e in zip(events, events[1:]):
        if e["ts"] - (before["ts"] + before["dur"]) > 50:
            runs.append([])
        runs[-1].append(e)
    return [run for run in runs if len(run) == len(runs[-1])]  # drop a partial first one


def on_path(run: list[dict]) -> list[float]:
    """Each kernel's charge (us) on the critical path of one replay; they sum to the span."""
    latest, charges = run[0]["ts"], []
    for e in run:
        end = e["ts"] + e["dur"]
        charges.append(max(0.0, end - latest))
        latest = max(latest, end)
    return charges


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", choices=BENCH_SHAPES, default="qwen3-0.6b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        engine_args = decode_engine_args([args.batch], args.context)
        llm = LLM(write_model_dir(args.shape, d), load_format="dummy",
                  max_model_len=max(4096, args.context), **engine_args)
    step = decode_step(args.batch, args.context, llm.runner.block_size)
    warm_up = paced_run(llm.runner, step, "cuda")
    for _ in range(5):
        warm_up()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            llm.runner.run(step)
            torch.cuda.synchronize()  # a gap between replays: where one ends is unambiguous
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        runs = replays(f.name)

    names = [e["name"][:60] for e in runs[0]]
    charges = [sum(column) / len(runs) for column in zip(*map(on_path, runs))]
    busy = [sum(column) / len(runs) for column in zip(*([e["dur"] for e in run] for run in runs))]
    rows = defaultdict(lambda: [0, 0.0, 0.0])
    for name, charge, dur in zip(names, charges, busy):
        rows[name][0] += 1
        rows[name][1] += charge
        rows[name][2] += dur
    span = sum(charges)
    print(f"{args.shape}, batch {args.batch}, context {args.context}, {torch.cuda.get_device_name()}: one replay spans "
          f"{span / 1000:.3f} ms, {len(names)} kernels, {sum(busy) / 1000:.3f} ms busy (mean of {len(runs)} replays)")
    print(f"{'on path':>10} {'busy':>10} {'count':>6}  kernel")
    for name, (count, charge, dur) in sorted(rows.items(), key=lambda r: -r[1][1])[:15]:
        print(f"{charge / 1000:7.3f} ms {dur / 1000:7.3f} ms {count:5d}x  {name}")

    # One layer: from an attention kernel to the next, averaged over the layers.
    layers = SHAPES[args.shape]["num_hidden_layers"]
    starts = [i for i, name in enumerate(names) if "attention" in name.lower() or "decode_kernel" in name]
    if len(starts) == layers:
        period = starts[1] - starts[0]
        print(f"one layer, in order (us, mean of {layers - 1} layers): on path / busy")
        for offset in range(period):
            column = [starts[0] + layer * period + offset for layer in range(layers - 1)]
            print(f"{sum(charges[i] for i in column) / len(column):8.2f} {sum(busy[i] for i in column) / len(column):8.2f}"
                  f"  {names[column[0]]}")
    print(json.dumps({"shape": args.shape, "batch": args.batch, "span_ms": span / 1000,
                      "kernels": len(names), "on_path_ms": {k: round(v[1] / 1000, 4) for k, v in rows.items()}}))
