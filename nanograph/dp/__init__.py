"""Data-parallel serving: N replicas of the server behind SGLang's router `smg` (an extension;
docs/serving.md, "Replicas"). `launcher.py` starts, watches and stops the processes; the routing
is smg's. `python -m nanograph.serve MODEL --data-parallel-size N` reaches it through
serve/cli.py.
"""
