"""--plot PATH: decode-step latency by batch size (left) and throughput bars (right), from the
report bench.py builds (the same figures --json writes). Needs matplotlib; without it, a note.
"""


def throughput_bars(shapes: dict) -> list[tuple[str, float]]:
    """(label, tok/s) of every throughput row in the report: compare (or the reference run),
    the other overlap mode, the ladders."""
    bars = []
    for name, report in shapes.items():
        prefix = f"{name}: " if len(shapes) > 1 else ""
        run = [report["run"]] if "run" in report else []
        rows = list(report.get("compare", {}).get("rows") or run)
        rows += [r for r in report.get("overlap", {}).get("rows", [])
                 if r["engine"] != report["run"]["engine"]]
        rows += [dict(r, engine=f"ladder {r['engine']}")
                 for r in report.get("ladders", {}).get("rows", [])]
        for r in rows:
            if r["error"]:
                continue
            engine = r["engine"].split(" [")[0].replace(" (continuous batching)", "")
            note = f" ({r['note']})" if r["note"] else ""
            bars.append((prefix + engine + note, r["tokens_per_s"]))
    return bars


def plot_decode_latency(axes, shapes: dict) -> None:
    sweeps = {name: r["decode_sweep"] for name, r in shapes.items()
              if r.get("decode_sweep", {}).get("rows")}
    if not sweeps:
        axes.text(0.5, 0.5, "decode sweep not run", ha="center", va="center")
        axes.set_axis_off()
        return
    for name, sweep in sweeps.items():
        prefix = f"{name}, " if len(shapes) > 1 else ""
        for key, style, what in (("graph_ms", "o-", "CUDA graph"), ("eager_ms", "s--", "eager")):
            points = [(r["batch"], r[key]) for r in sweep["rows"] if r[key]]
            if points:
                axes.plot(*zip(*points), style, label=prefix + what)
    batches = sorted({r["batch"] for sweep in sweeps.values() for r in sweep["rows"]})
    axes.set_xscale("log", base=2)
    axes.set_xticks(batches, [str(b) for b in batches], fontsize=7)
    axes.set_xlabel("batch size")
    axes.set_ylabel("ms per decode step")
    axes.set_title(f"Decode step latency, context {next(iter(sweeps.values()))['context_len']}")
    axes.legend(fontsize=7)
    axes.grid(True, alpha=0.3)


def plot_throughput(axes, shapes: dict, quick: bool) -> None:
    bars = throughput_bars(shapes)
    if not bars:
        axes.text(0.5, 0.5, "no throughput run", ha="center", va="center")
        axes.set_axis_off()
        return
    names, values = zip(*bars)
    axes.barh(range(len(values)), values)
    axes.set_yticks(range(len(values)), names)
    axes.invert_yaxis()
    axes.set_xlabel("output tokens / s")
    axes.set_title("Throughput, reference workload" if not quick else "Throughput (quick)")
    for i, v in enumerate(values):
        axes.text(v, i, f" {v:,.0f}", va="center")
    axes.set_xlim(0, max(values) * 1.2 or 1)


def write_plot(path: str, report: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\n(--plot skipped: matplotlib is not installed; pip install matplotlib)")
        return
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    shapes = report["shapes"]
    plot_decode_latency(left, shapes)
    plot_throughput(right, shapes, report["meta"]["quick"])
    fig.suptitle(f"nanograph bench: {', '.join(shapes)} on {report['meta']['device_name']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot written to {path}")
