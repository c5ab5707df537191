"""bench.py's sections and what they share. `python bench.py --help` lists the flags.

Shared by every section:
    shapes.py        public model shapes as config.json (random weights), the tiny ones of --quick
    workloads.py     the reference workload (nano-vllm's), the quick and warm-up workloads
    timing.py        clocks, copy bandwidth, GPU busy share, the engine's counters around one call
    report.py        one run's figures (RunResult) and the tables they print as
    harness.py       Setup (one shape's settings, builds engines) and timing a generate call
    runner.py        the only place bench reaches into the engine: a hand-built decode step
    checkpoint.py    the shape's random weights as a checkpoint, for engines without dummy weights;
                     a word-level tokenizer for a vocabulary

One module per section, each with an entry `section_<name>(setup)` that prints its tables and
returns its figures:
    run.py           the reference workload (the default section)
    compare.py       nanograph graphs / eager, hf.py (HF transformers), peers.py (nano-vllm, vLLM)
    overlap.py       overlap scheduling on and off
    ladders.py       bucket ladders
    decode_sweep.py  one decode step by batch size, graph and eager, against its floor
    lora.py          multi-LoRA: step cost, capture cost, end to end
    serving.py       a server's view through the step API: TTFT, inter-token latency, tokens/s,
                     decode-first against prefill-first scheduling
    serving_http.py  serving.py's Poisson workloads in process and through the OpenAI-compatible
                     server on 127.0.0.1 (a subprocess): the HTTP layer's cost
    spec.py          speculative decoding: the mechanics at a set acceptance (spec_acceptance.py:
                     the bench-only scheduler that forces it), prompt lookup on the demo model
    kv_bandwidth.py  the split-KV decode kernel's K/V bytes a second against the copy bandwidth
                     (measured by tools/kv_bandwidth.py in a process of its own)
    mixed_step_cost.py  a decode step alone and beside prefill tokens, through LLM.step()
    plot.py          --plot's figure from the JSON report

A new section is a module with its `section_<name>(setup) -> dict`, a flag in bench.py's
`parse_args` and a line in its `run_sections`.

Tools (tools/) import these modules; run them from the repository root as `python -m tools.<name>`.
"""
