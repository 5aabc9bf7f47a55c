"""Simulator benchmark: ``python -m fedfew.bench [--full] [--out DIR]`` (``make bench``).

Writes ``bench.json`` (every figure) and ``bench.md`` (tables) atomically into ``--out``
(default ``outputs/bench``). Every measurement runs in its own subprocess, so each reports
its own peak host memory (``ru_maxrss``) and, on a GPU, peak device memory.

``python -m fedfew.bench --gpu-check`` (``make gpu-check`` via ``scripts/gpu_check.sh``; see
docs/speed.md) is the GPU readiness check: loop == vmap after 2 rounds, engine speed with
multi-client chunks, bf16-mixed vs fp32, the paper's CIFAR-10 run projected to 2,000 rounds,
peak GPU memory against M and K, and FLOP/s against matmul peaks, each section under a time
cap, the issue's targets judged in ``bench.md``. Without a GPU it runs the same code at tiny
sizes (the CPU smoke mode, under a minute). See :mod:`fedfew.bench.gpu_driver`.

The modules:

- :mod:`~fedfew.bench.__main__`: the command line (parses the flags, dispatches to a program).
- Shared: :mod:`~fedfew.bench.common` (progress lines, load average, device, the issue's targets,
  number formats), :mod:`~fedfew.bench.synthetic` (CIFAR-10- and AG-News-shaped data),
  :mod:`~fedfew.bench.measure` (matmul peaks, useful FLOPs, the pure forward/backward replay),
  :mod:`~fedfew.bench.cases` (one bench case: a Simulation and its timed round, in a subprocess).
- The CPU benchmark: :mod:`~fedfew.bench.cpu` (what it measures, the driver),
  :mod:`~fedfew.bench.flower_speed` (Flower's simulation engine beside the simulator),
  :mod:`~fedfew.bench.cpu_report` (bench.md).
- The GPU check: :mod:`~fedfew.bench.gpu_sizes` (its modes, sizes and time caps),
  :mod:`~fedfew.bench.gpu_data` (CIFAR-10 unpacked in the background),
  :mod:`~fedfew.bench.gpu_context` (what a section works with), :mod:`~fedfew.bench.gpu_sections`
  (the sections), :mod:`~fedfew.bench.gpu_runner` (the sections in order, in one process),
  :mod:`~fedfew.bench.gpu_driver` (the budget, the processes, the files),
  :mod:`~fedfew.bench.gpu_report` (targets and bench.md).
"""
