"""Scripts a user or developer runs, each a module run from the repository root:
`python -m tools.<name> --help`. tools/README.md lists them; they import `nanograph` and
`benchmarks` (bench.py's shapes, workloads and decode-step timing) like any other module.
"""
