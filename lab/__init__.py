"""The research harness: RULER-style tasks, sweeps, calibration, records, reports, plots and the benchmark (README.md).

It imports the method; the method never imports it. Run its tools from the repository root: python -m lab.sweep ...
"""
