"""What a run writes and shows: result files, console, plots, loggers, W&B, the collapse watch, the partition report."""
