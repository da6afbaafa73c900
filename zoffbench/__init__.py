"""The benchmarks' and checks' library: what the entry points of scripts/bench/ and scripts/checks/ share.

- harness.py: child processes (`run_command`, `run_function`, `call`; serve.py is the child's entry), their memory and
  results, failure lines, the schema of bench.py's entries; model_shapes.py: the models by name; results.py:
  `write_result`, the one file rule; recorders.py: the Lightning callbacks that time steps.
- bench.py: scripts/bench/bench.py's body (its options, the runs' table, the JSON and the plot).
- runs.py: the runs scripts/bench/bench.py measures (`RUN_SPECS`, `run_one`), built from deepspeed_runs.py (DeepSpeed's
  configurations), fabric_run.py (the Fabric loop's run), data.py (the random tokens), host_floor.py (the host update
  against the machine's floor); plot.py draws a call's runs.
- sample_bench.py, consolidate_bench.py: the bodies of scripts/bench/bench_sample.py and bench_consolidate.py (their
  ranks' functions run in children by name).
- checks/: the checks behind scripts/checks/check_{overlap,placement,reference,scaling}.py, which tests/gpu runs.

Imports go one way: the runs import the library modules, never the reverse, and nothing here imports a script
(tests/test_bench_layout.py).
"""
