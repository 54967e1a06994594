"""reamer's benchmarks: one module per bench, run from the repository root as ``python -m bench.<name>``.

Shared parts: ``bench.harness`` (results folders, machine and load, the reproducing command, rounds, medians,
ratios, JSON and RESULTS.md sections), ``bench.models`` (the model files the benches measure) and
``bench.simulator`` (the calibrated layout-search simulator). ``bench.run_all`` is ``make bench``.
Importing this package imports nothing else: a bench process sets its environment before its own imports.
"""
