"""HF transformers' continuous batching on the same shape and workload, as a --compare row.

HF's `generate_batch` takes a single `max_new_tokens` for all requests, so bench drives its
`ContinuousBatchingManager` directly (`init_continuous_batching`, `add_request(...,
max_new_tokens=n)`, `get_result`), which is what `generate_batch` does underneath, with each
request's own length; sampling as nanograph's (temperature, no top-k / top-p), EOS disabled. HF is
much slower, so it runs only the workload's first `--hf-seqs` sequences (compare.py sets the
ratio against nanograph on those same sequences). The model is HF's random init of the shape
(checkpoint.py); the warm-up workload runs first, off the clock, as for every engine.
"""
import inspect
import time

from benchmarks.checkpoint import load_hf_model
from benchmarks.harness import Setup, report_leftover_memory
from benchmarks.report import RunResult
from benchmarks.timing import free_memory, is_cuda
from benchmarks.workloads import Workload

ATTENTION_IMPLEMENTATIONS = ("paged|sdpa", "sdpa", "paged|eager")  # the first this version knows


def hf_manager(model, setup: Setup, workload: Workload):
    """A started ContinuousBatchingManager with sampling like nanograph's and EOS disabled."""
    from transformers import GenerationConfig
    gen = GenerationConfig(do_sample=workload.temperature > 0, temperature=workload.temperature,
                           top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
                           max_new_tokens=max(workload.max_tokens))
    kwargs = {}
    params = inspect.signature(model.init_continuous_batching).parameters
    if not is_cuda(setup.device) and "continuous_batching_config" in params:
        # HF sizes its cache from memory; on a CPU that means minutes of zero-filling: keep it small
        from transformers import ContinuousBatchingConfig
        longest = max(len(p) + n for p, n in zip(workload.prompts, workload.max_tokens))
        kwargs["continuous_batching_config"] = ContinuousBatchingConfig(
            num_blocks=workload.num_seqs * -(-longest // 256) + 8, max_batch_tokens=512)
    if "workload_hints" in params:  # as generate_batch passes them, so HF sizes itself alike
        try:
            from transformers.generation.continuous_batching.utils import WorkloadHints
            kwargs["workload_hints"] = WorkloadHints(
                max_prompt_length=max(map(len, workload.prompts)),
                max_generated_length=max(workload.max_tokens),
                num_requests=workload.num_seqs)
        except ImportError:
            pass
    manager = model.init_continuous_batching(generation_config=gen, **kwargs)
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    return manager


def hf_generate(manager, workload: Workload, prefix: str,
                timeout_s: float) -> tuple[int, float, str | None]:
    """Submit every request with its own max_new_tokens, wait for all; (tokens, seconds, error)."""
    start = time.perf_counter()
    pending = set()
    for i, (prompt, n) in enumerate(zip(workload.prompts, workload.max_tokens)):
        request_id = f"{prefix}{i}"
        manager.add_request(prompt, request_id=request_id, max_new_tokens=n)
        pending.add(request_id)
    tokens, errors = 0, []
    while pending:
        result = manager.get_result(timeout=1)
        if result is None:
            elapsed = time.perf_counter() - start
            if not getattr(manager, "is_running", lambda: True)():
                return tokens, elapsed, "generation thread stopped unexpectedly"
            if elapsed > timeout_s:
                done = workload.num_seqs - len(pending)
                return tokens, elapsed, (f"timed out after {timeout_s:.0f} s "
                                         f"({done}/{workload.num_seqs} done)")
            continue
        if result.request_id not in pending or not result.is_finished():
            continue
        pending.discard(result.request_id)
        tokens += len(result.generated_tokens)
        if getattr(result, "error", None):
            errors.append(str(result.error))
    seconds = time.perf_counter() - start
    return tokens, seconds, (f"{len(errors)} request(s) failed: {errors[0]}" if errors else None)


def stop_manager(manager) -> None:
    try:  # a hard stop fails whatever is still pending (after a time-out) instead of finishing it
        stop_params = inspect.signature(manager.stop).parameters
        hard = {"hard_stop": True} if "hard_stop" in stop_params else {}
        manager.stop(block=True, timeout=30, **hard)
    except Exception as e:
        print(f"  (HF manager did not stop cleanly: {type(e).__name__}: {e})")


def run_hf(setup: Setup, workload: Workload) -> RunResult:
    """HF transformers' continuous batching on the same shape and workload. Never raises: a
    failure becomes the row's error."""
    import transformers
    label = f"HF transformers {transformers.__version__} (continuous batching)"
    subset = workload.head(setup.args.hf_seqs)
    note = ""
    if subset.num_seqs != workload.num_seqs:
        note = f"first {subset.num_seqs} of {workload.num_seqs} sequences"
    if subset.num_seqs == 0:
        return RunResult(label, error="skipped (--hf-seqs 0)")
    model = manager = None
    errors = []
    print(f"  [{label}] building the model, warming up, timing {subset.num_seqs} sequences ...",
          flush=True)
    try:
        for impl in ATTENTION_IMPLEMENTATIONS:
            try:
                model = load_hf_model(setup, impl)
                manager = hf_manager(model, setup, subset)
                break
            except Exception as e:  # a name this version does not know: try the next
                errors.append(f"{impl}: {type(e).__name__}: {e}")
                model = manager = None
                free_memory()
        if manager is None:
            return RunResult(label, subset.num_seqs, note=note, error=" | ".join(errors))
        label += f" [{model.config._attn_implementation}]"
        _, _, err = hf_generate(manager, setup.warmup, "warmup-", setup.args.hf_timeout)
        if err:
            return RunResult(label, subset.num_seqs, note=note, error=f"warm-up: {err}")
        tokens, seconds, err = hf_generate(manager, subset, "req-", setup.args.hf_timeout)
        if not err and tokens != subset.output_tokens:
            short = f"{tokens} of {subset.output_tokens} requested tokens"
            note = "; ".join(filter(None, [note, short]))
        return RunResult(label, subset.num_seqs, tokens, seconds, note, err)
    except Exception as e:
        return RunResult(label, subset.num_seqs, note=note, error=f"{type(e).__name__}: {e}")
    finally:
        if manager is not None:
            stop_manager(manager)
        del manager, model
        report_leftover_memory("the HF model")
