"""Evaluation of Coder policies on KernelBench-format suites: metrics, suites, runs and
reports (``docs/evaluation.md``)."""
