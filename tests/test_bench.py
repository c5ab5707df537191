"""bench.py: the reference workload is the one DESIGN.md names, and the quick run works end to end."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import bench  # noqa: E402


def test_reference_workload_is_nano_vllm_s():
    work = bench.reference_workload()
    assert work.num_seqs == 256
    assert work.output_tokens == bench.REFERENCE_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 for p in work.prompts)
    assert all(100 <= n <= 1024 for n in work.max_tokens)
    assert all(0 <= t <= 10000 for p in work.prompts for t in p)
    # drawn exactly as nano-vllm's bench.py does, from the global random module
    import random
    from random import randint
    random.seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
    max_tokens = [randint(100, 1024) for _ in range(256)]
    assert work.prompts == prompts and work.max_tokens == max_tokens


def test_workload_head_keeps_the_first_sequences():
    work = bench.reference_workload()
    head = work.head(64)
    assert head.prompts == work.prompts[:64] and head.max_tokens == work.max_tokens[:64]


def test_quick_workload_fits_the_tiny_model():
    work = bench.quick_workload()
    vocab = bench.SHAPES["tiny"]["vocab_size"]
    assert all(0 <= t < vocab for p in work.prompts for t in p)


def test_quick_bench_runs_end_to_end(tmp_path):
    out = tmp_path / "b.json"
    proc = subprocess.run([sys.executable, "bench.py", "--quick", "--device", "cpu", "--compare", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert {"meta", "workload", "run", "compare"} <= set(report)
    requested = bench.quick_workload().output_tokens
    assert report["workload"]["output_tokens"] == requested

    run = report["run"]
    assert run["output_tokens"] == requested  # ignore_eos: every request runs to its max_tokens
    assert run["tokens_per_s"] > 0 and run["error"] is None

    rows = {row["engine"].split(" ")[0] + (" eager" if "eager" in row["engine"] else ""): row
            for row in report["compare"]["rows"]}
    assert set(rows) == {"nanograph", "nanograph eager", "HF"}
    for name in ("nanograph", "nanograph eager"):
        assert rows[name]["output_tokens"] == requested
        assert rows[name]["tokens_per_s"] > 0
    hf = rows["HF"]
    assert hf["error"] is None, hf["error"]
    assert hf["output_tokens"] == requested and hf["tokens_per_s"] > 0
