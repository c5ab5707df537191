"""One run's figures, and the plain-text tables every section prints."""
from dataclasses import asdict, dataclass, field


@dataclass
class RunResult:
    """One engine's timed generate call on one workload: a row of a throughput table."""
    engine: str
    num_seqs: int = 0
    output_tokens: int = 0
    seconds: float = 0.0
    note: str = ""
    error: str | None = None
    stats: dict = field(default_factory=dict)
    probe: dict = field(default_factory=dict)  # --overlap: batch-1 and GPU-busy figures
    vs_nanograph: float | None = None  # --compare: tok/s over nanograph's (graphs), same sequences

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 and not self.error else 0.0

    def to_dict(self) -> dict:
        return dict(asdict(self), tokens_per_s=self.tokens_per_s)


def print_table(title: str, headers: list[str], rows: list[list]) -> None:
    """The title, then the rows under the headers: the first column left-aligned, others right."""
    cells = [[str(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}\n{line}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print(line)
    for row in cells:
        aligned = [c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(aligned))
    print(line)


def mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def cell(value, spec: str = ".3f", suffix: str = "") -> str:
    """A table cell: the value formatted, or '-' where there is none."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def on_off(flag: bool) -> str:
    return "on" if flag else "off"
