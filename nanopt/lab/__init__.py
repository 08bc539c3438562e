"""Many runs: sweeps, seeds and statistics, comparisons, plots, eval --watch, averaging."""
