"""Peers: other engines that speak vLLM's offline API, each timed in a subprocess of its own.

A peer is anything with `LLM(path, dtype=..., max_model_len=..., tensor_parallel_size=...)` and
`llm.generate(prompts, [SamplingParams(temperature, max_tokens, ignore_eos)])`: nano-vllm and
vLLM. Each runs the whole workload in a subprocess (`python bench.py --peer-job JOB`: its own CUDA
context, all its memory back when it exits) on the checkpoint of checkpoint.py, with the same
prompts (token ids), per-request lengths and temperature, EOS ignored; it generates the same
warm-up workload first and times one generate call as nanograph's is timed, then prints its
figures as one JSON line (`PEER_TAG` + JSON) that bench reads. Peers are imported from
`--peer-path` (default: every directory in `.peers/` next to bench.py, e.g. nano-vllm's source)
and the usual sys.path. A peer that cannot run here (nano-vllm: Qwen3 only, CUDA only,
flash-attn) or does not import is a skipped row with the reason.
"""
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from benchmarks.harness import Setup
from benchmarks.report import RunResult
from benchmarks.timing import is_cuda


@dataclass
class Peer:
    name: str
    module: str  # `from <module> import LLM, SamplingParams`
    model_types: tuple = ()  # the model types it implements (empty: any)
    cuda_only: bool = False
    prompt_dicts: bool = False  # prompts as {"prompt_token_ids": ids} (vLLM), else the ids


PEERS = [
    # nano-vllm needs flash-attn, NCCL and CUDA graphs
    Peer("nano-vllm", "nanovllm", model_types=("qwen3",), cuda_only=True),
    Peer("vLLM", "vllm", prompt_dicts=True),
]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH_PY = os.path.join(ROOT, "bench.py")
PEER_DIR = os.path.join(ROOT, ".peers")  # e.g. .peers/nano-vllm (a source tree)
PEER_TAG = "bench peer result: "  # the subprocess's one line of figures: PEER_TAG + JSON


def cannot_run(setup: Setup, peer: Peer, model_type: str) -> str | None:
    """Why the peer cannot run here (known without starting it), or None."""
    if peer.model_types and model_type not in peer.model_types:
        return f"implements {', '.join(peer.model_types)} only, not {model_type}"
    if peer.cuda_only and not is_cuda(setup.device):
        return "runs on CUDA only"
    return None


def run_peer(setup: Setup, peer: Peer, checkpoint: str) -> RunResult:
    """One peer on the whole workload, in a subprocess. Never raises: a peer that cannot run here
    (the model type, the device) or does not import is a skipped row, any other failure the row's
    error (the tail of its stderr printed)."""
    args, work = setup.args, setup.workload
    with open(os.path.join(checkpoint, "config.json")) as f:
        model_type = json.load(f)["model_type"]
    if reason := cannot_run(setup, peer, model_type):
        return RunResult(peer.name, work.num_seqs, error=f"skipped: {reason}")
    engine_args = {"dtype": setup.dtype, "max_model_len": args.max_model_len,
                   "tensor_parallel_size": args.tp}
    job = {"module": peer.module, "prompt_dicts": peer.prompt_dicts, "model": checkpoint,
           "engine_args": engine_args, "warmup": asdict(setup.warmup), "workload": asdict(work)}
    job_path = os.path.join(setup.tmp, f"{setup.name}-{peer.module}-job.json")
    with open(job_path, "w") as f:
        json.dump(job, f)
    python_path = os.pathsep.join(filter(None, [args.peer_path, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=python_path)
    print(f"  [{peer.name}] in a subprocess: building the engine, warming up, timing "
          f"{work.num_seqs} sequences ...", flush=True)
    try:
        proc = subprocess.run([sys.executable, BENCH_PY, "--peer-job", job_path], env=env,
                              capture_output=True, text=True, timeout=args.peer_timeout)
    except subprocess.TimeoutExpired:
        error = f"timed out after {args.peer_timeout:.0f} s"
        return RunResult(peer.name, work.num_seqs, error=error)
    lines = proc.stdout.splitlines()
    results = [line[len(PEER_TAG):] for line in lines if line.startswith(PEER_TAG)]
    if proc.returncode or not results:
        tail = proc.stderr.strip().splitlines()[-20:] or ["no output"]
        print("\n".join(f"    | {line}" for line in tail))
        error = f"exit status {proc.returncode}: {tail[-1]}"
        return RunResult(peer.name, work.num_seqs, error=error)
    result = json.loads(results[-1])
    if "skipped" in result:
        return RunResult(peer.name, work.num_seqs, error=f"skipped: {result['skipped']}")
    label = " ".join(filter(None, [peer.name, result["version"]]))
    note = ""
    if result["output_tokens"] != work.output_tokens:
        note = f"expected {work.output_tokens} output tokens"
    return RunResult(label, work.num_seqs, result["output_tokens"], result["seconds"], note)


def peer_job(job_path: str) -> None:
    """The peer's side (`python bench.py --peer-job JOB`): import it, build its LLM on the
    checkpoint, generate the warm-up workload, time one generate of the workload; print
    PEER_TAG + JSON."""
    import importlib
    with open(job_path) as f:
        job = json.load(f)
    try:
        peer = importlib.import_module(job["module"])
    except Exception as e:  # not installed, or a dependency missing (nano-vllm imports flash_attn)
        reason = f"{job['module']} does not import: {type(e).__name__}: {e}"
        print(PEER_TAG + json.dumps({"skipped": reason}))
        return
    llm = peer.LLM(job["model"], **job["engine_args"])

    def generate(work: dict) -> int:
        prompts = work["prompts"]
        if job["prompt_dicts"]:
            prompts = [{"prompt_token_ids": p} for p in prompts]
        temperature = work["temperature"]
        params = [peer.SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=n)
                  for n in work["max_tokens"]]
        # nano-vllm returns dicts, vLLM RequestOutputs
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o["token_ids"] if isinstance(o, dict) else o.outputs[0].token_ids)
                   for o in outs)

    generate(job["warmup"])
    start = time.perf_counter()
    tokens = generate(job["workload"])
    seconds = time.perf_counter() - start
    figures = {"version": getattr(peer, "__version__", None), "seconds": seconds,
               "output_tokens": tokens}
    print(PEER_TAG + json.dumps(figures), flush=True)
