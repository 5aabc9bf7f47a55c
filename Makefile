# fedfew: the commands a user needs. `make train` and `make test` install on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DATASET ?= digits
DATA_DIR ?=
ARGS ?=
PYTEST_ARGS ?=
# the real data beside the checkout (../shared/data) is used by the tests when present
SHARED_DATA := $(abspath ../shared/data)
TEST_DATA_DIR := $(or $(DATA_DIR),$(FEDFEW_DATA_DIR),$(wildcard $(SHARED_DATA)))
DATA_ARG := $(if $(DATA_DIR),data_dir=$(abspath $(DATA_DIR)),)

.PHONY: install train test compare bench slurm slurm-up slurm-down clean help runs notebook

help:
	@echo "make install | train DATASET=<name> [DATA_DIR=<dir>] [ARGS='<hydra overrides>'] | test | runs [ROOT=<dir>] | notebook RUN=<run dir>"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[test,notebook]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m fedfew.train dataset=$(DATASET) $(DATA_ARG) $(ARGS)

# runs: past runs, newest first, with their headline figures (ROOT: a folder to search; default
# $FEDFEW_OUTPUT_DIR, else outputs and multirun)
ROOT ?=
runs: $(STAMP)
	@$(BIN)/python -m fedfew.runs $(ROOT)

# notebook: execute notebooks/analysis.ipynb on a run (or a folder of runs) -> <RUN>/analysis.html
#   make notebook RUN=outputs/digits/fedfew/<time>
RUN ?=
notebook: $(STAMP)
	@test -n "$(RUN)" || { echo "usage: make notebook RUN=<run folder or folder of runs> (make runs lists them)"; exit 2; }
	@$(BIN)/python -m fedfew.notebook $(RUN)

test: $(STAMP)
	FEDFEW_DATA_DIR=$(TEST_DATA_DIR) WANDB_MODE=$${WANDB_MODE:-offline} WANDB_SILENT=true \
		$(BIN)/python -m pytest $(PYTEST_ARGS)

# SLURM: render scripts/slurm/job.sbatch.template and submit it (one task per device)
NODES ?= 1
GPUS ?= 0
TASKS ?= $(if $(filter 0,$(GPUS)),1,$(GPUS))
CPUS ?= 1
TIME ?= 01:00:00
PARTITION ?= $(or $(FEDFEW_SLURM_PARTITION),debug)
SLURM_OUT ?= $(abspath outputs/slurm)
ACCELERATOR ?= $(if $(filter 0,$(GPUS)),cpu,gpu)

slurm: $(STAMP)
	mkdir -p $(SLURM_OUT)
	$(BIN)/python scripts/slurm/render.py --submit --job-name fedfew-$(DATASET) --nodes $(NODES) \
		--ntasks-per-node $(TASKS) --gpus-per-node $(GPUS) --cpus-per-task $(CPUS) --time $(TIME) \
		--partition $(PARTITION) --output $(SLURM_OUT)/%j.out --workdir $(CURDIR) \
		--python $(abspath $(BIN)/python) --run-root $(SLURM_OUT) --script $(SLURM_OUT)/last.sbatch -- \
		dataset=$(DATASET) $(DATA_ARG) trainer.accelerator=$(ACCELERATOR) trainer.strategy=ddp $(ARGS)

# compare: every algorithm on the same partitions and budget -> $(OUT)/compare.{csv,md};
# finished runs are reused (an interrupted comparison resumes). ARGS go to every run.
# ALGORITHMS defaults to every registered one: fedfew and the baselines fedavg fedprox local ifca
# fedrep ditto apfl fedamp fedmtl cfl fedsoft fedmgda (README, "Baselines").
# JOBS=N runs N at a time, each with one torch thread (N processes on N cores, no oversubscription).
#   make compare DATASET=agnews ALGORITHMS="fedfew fedavg ifca" SEEDS="0 1 2" ARGS="rounds=10" JOBS=2
ALGORITHMS ?=
SEEDS ?= 0
JOBS ?= 1
OUT ?= outputs/compare/$(DATASET)
COMPARE_DATA_DIR := $(or $(DATA_DIR),$(FEDFEW_DATA_DIR),$(wildcard $(SHARED_DATA)))

compare: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} WANDB_SILENT=true $(BIN)/python -m fedfew.compare --dataset $(DATASET) \
		$(if $(strip $(ALGORITHMS)),--algorithms $(ALGORITHMS)) --seeds $(SEEDS) --out $(OUT) --jobs $(JOBS) \
		-- $(if $(COMPARE_DATA_DIR),data_dir=$(abspath $(COMPARE_DATA_DIR))) $(if $(filter-out 1,$(JOBS)),trainer.threads=1) $(ARGS)

# bench: throughput (engine=loop vs vmap), overhead, FLOP/s, scaling in M and K, memory, the
# reference preset and devices=1 vs 2 -> $(BENCH_OUT)/bench.{json,md}. ~10 min on 2 CPU cores.
#   make bench [BENCH_ARGS="--full"]   (--full: the paper's sizes, the default on a GPU)
BENCH_OUT ?= outputs/bench
BENCH_ARGS ?=

bench: $(STAMP)
	$(BIN)/python -m fedfew.bench --out $(BENCH_OUT) $(if $(TEST_DATA_DIR),--data-dir $(abspath $(TEST_DATA_DIR))) $(BENCH_ARGS)

slurm-up:
	bash scripts/slurm/install.sh && bash scripts/slurm/start.sh

slurm-down:
	bash scripts/slurm/stop.sh

clean:
	rm -rf outputs multirun .pytest_cache .hypothesis
