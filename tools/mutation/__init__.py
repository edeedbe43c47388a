"""Mutation testing for pagedkit, time-boxed for a 2-core machine: `python -m tools.mutation` (see __main__.py
and docs/testing.md). components.py is the component table, mutants.py the mutants (cosmic-ray's operators,
filtered), kernels.py the hand-written Triton list, runner.py the fork-based runner on repository copies."""
