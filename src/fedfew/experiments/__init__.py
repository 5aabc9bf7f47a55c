"""Many runs: run folders, training subprocesses, tuning and comparison."""
