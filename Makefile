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

.PHONY: install train test compare bench slurm slurm-up slurm-down clean help runs notebook tune flower lint

help:
	@echo "make install | train DATASET=<name> [DATA_DIR=<dir>] [ARGS='<hydra overrides>'] | test | lint | runs [ROOT=<dir>] | notebook RUN=<run dir>"
	@echo "     tune DATASET=<name> ALGORITHMS='...' | compare DATASET=<name> ALGORITHMS='...' SEEDS='0 1 2' JOBS=2"
	@echo "     slurm DATASET=<name> NODES=<n> GPUS=<g> TIME=<hh:mm:ss> [DATA_ON_NODES=1] | slurm-up | slurm-down | bench | gpu-check  (README.md, docs/)"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install -e '.[test,notebook,flower]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python -m fedfew.train dataset=$(DATASET) $(DATA_ARG) $(ARGS)

# flower: the same run as `make train` in Flower's simulation engine (one virtual SuperNode per client,
# fedfew's own algorithms; same run folder and files, plus flower.log/flower.json; docs/flower.md).
#   make flower ARGS="num_clients=8 rounds=5"   (FLOWER_ARGS="--workers 2 --round-timeout 60")
FLOWER_ARGS ?=
flower: $(STAMP)
	$(BIN)/python -m fedfew.flower $(FLOWER_ARGS) dataset=$(DATASET) $(DATA_ARG) $(ARGS)

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

lint: $(STAMP)
	$(BIN)/ruff check src tests scripts

test: $(STAMP) lint
	FEDFEW_DATA_DIR=$(TEST_DATA_DIR) WANDB_MODE=$${WANDB_MODE:-offline} WANDB_SILENT=true \
		$(BIN)/python -m pytest $(PYTEST_ARGS)

# SLURM: check the run config on this node (`python -m fedfew.check`: the checks `make train` makes
# before loading data, and that the dataset's files are under DATA_DIR, a few seconds; a bad config or
# a missing data path is never queued; DATA_ON_NODES=1 skips the files check for data that exists only
# on the compute nodes), render
# scripts/slurm/job.sbatch.template and submit it (one task per device); prints the job id, the run
# folder and the `tail -F` command that follows the job's log (docs/clusters.md).
NODES ?= 1
GPUS ?= 0
TASKS ?= $(if $(filter 0,$(GPUS)),1,$(GPUS))
CPUS ?= 1
TIME ?= 01:00:00
PARTITION ?= $(or $(FEDFEW_SLURM_PARTITION),debug)
OUTPUTS := $(or $(FEDFEW_OUTPUT_DIR),outputs)
SLURM_OUT ?= $(abspath $(OUTPUTS)/slurm)
ACCELERATOR ?= $(if $(filter 0,$(GPUS)),cpu,gpu)
DATA_ON_NODES ?=

slurm: $(STAMP)
	mkdir -p $(SLURM_OUT)
	$(BIN)/python scripts/slurm/render.py --submit --check $(if $(filter-out 0,$(DATA_ON_NODES)),--data-on-nodes) --job-name fedfew-$(DATASET) --nodes $(NODES) \
		--ntasks-per-node $(TASKS) --gpus-per-node $(GPUS) --cpus-per-task $(CPUS) --time $(TIME) \
		--partition $(PARTITION) --output $(SLURM_OUT)/%j.out --workdir $(CURDIR) \
		--python $(abspath $(BIN)/python) --run-root $(SLURM_OUT) --script $(SLURM_OUT)/last.sbatch -- \
		dataset=$(DATASET) $(DATA_ARG) trainer.accelerator=$(ACCELERATOR) trainer.strategy=ddp $(ARGS)

# compare: every algorithm on the same partitions and budget -> compare.{csv,md} and PNGs in COMPARE_OUT
# (default outputs/compare/<dataset><ARGS as in a run folder's name>[_presets-<name>]); finished runs are reused (an interrupted
# comparison resumes: the same command again). ARGS go to every run.
# ALGORITHMS defaults to every registered one that can run on the setup (docs/algorithms.md);
# the ones left out (e.g. oracle without client groups) are named, before any run starts.
# JOBS=N runs N at a time, each with one torch thread (N processes on N cores, no oversubscription).
#   make compare DATASET=agnews ALGORITHMS="fedfew fedavg ifca" SEEDS="0 1 2" ARGS="rounds=10" JOBS=2
ALGORITHMS ?=
SEEDS ?= 0
JOBS ?= 1
COMPARE_OUT ?=
COMPARE_DATA_DIR := $(or $(DATA_DIR),$(FEDFEW_DATA_DIR),$(wildcard $(SHARED_DATA)))

# PRESETS=<dir>: each method's preset from <dir>/<dataset>_<alg>.yaml (make tune's <out>/presets, tuned for
# another setup) instead of conf/tuned; PRESETS=none: config defaults. compare.md/csv + PNGs: docs/results.md.
PRESETS ?=

compare: $(STAMP)
	WANDB_MODE=$${WANDB_MODE:-offline} WANDB_SILENT=true $(BIN)/python -m fedfew.compare --dataset $(DATASET) \
		$(if $(strip $(ALGORITHMS)),--algorithms $(ALGORITHMS)) --seeds $(SEEDS) $(if $(COMPARE_OUT),--out $(COMPARE_OUT)) --jobs $(JOBS) \
		$(if $(PRESETS),--presets $(PRESETS)) \
		-- $(if $(COMPARE_DATA_DIR),data_dir=$(abspath $(COMPARE_DATA_DIR))) $(if $(filter-out 1,$(JOBS)),trainer.threads=1) $(ARGS)

# tune: the same Optuna search (TPE, TRIALS finished trials per method) for every method, scored on the clients'
# validation split (VAL_FRACTION of each train split; the test split is never read); presets -> <TUNE_OUT>/presets
# (default outputs/tune/<dataset><ARGS as in a run folder's name>)
# and, when ARGS keep the dataset's default setup, conf/tuned/<dataset>_<alg>.yaml (docs/tuning.md). Resumable.
#   make tune DATASET=digits ALGORITHMS="fedfew fedavg fedrep" TRIALS=12 JOBS=2
TRIALS ?= 12
VAL_FRACTION ?= 0.2
TUNE_SEEDS ?= 0 1
INSTALL ?= auto
TUNE_OUT ?=

tune: $(STAMP)
	FEDFEW_TUNE_MADE_BY='make tune DATASET=$(DATASET) ALGORITHMS="$(ALGORITHMS)" TRIALS=$(TRIALS) JOBS=$(JOBS) TUNE_SEEDS="$(TUNE_SEEDS)" VAL_FRACTION=$(VAL_FRACTION) ARGS="$(ARGS)"' \
	WANDB_MODE=disabled WANDB_SILENT=true $(BIN)/python -m fedfew.tune --dataset $(DATASET) \
		$(if $(strip $(ALGORITHMS)),--algorithms $(ALGORITHMS)) --trials $(TRIALS) --jobs $(JOBS) \
		--seeds $(TUNE_SEEDS) --val-fraction $(VAL_FRACTION) --install $(INSTALL) $(if $(TUNE_OUT),--out $(TUNE_OUT)) \
		-- $(if $(COMPARE_DATA_DIR),data_dir=$(abspath $(COMPARE_DATA_DIR))) $(if $(filter-out 1,$(JOBS)),trainer.threads=1) $(ARGS)

# bench: throughput (engine=loop vs vmap), overhead, FLOP/s, scaling in M and K, memory, the
# reference preset, devices=1 vs 2, and Flower's simulation engine beside the simulator (s/round and
# startup on the digits job, M = BENCH_FLOWER_CLIENTS, fedavg and fedfew, BENCH_FLOWER_ROUNDS rounds)
# -> $(BENCH_OUT)/bench.{json,md}. ~15 min on 2 CPU cores (the Flower section ~6 of them).
#   make bench [BENCH_ARGS="--full"]   (--full: the paper's sizes, the default on a GPU)
#   make bench BENCH_ARGS="--only flower"  |  BENCH_ARGS=--no-flower  |  BENCH_FLOWER_CLIENTS="20" BENCH_FLOWER_ROUNDS=3
BENCH_OUT ?= $(OUTPUTS)/bench
BENCH_ARGS ?=
BENCH_FLOWER_CLIENTS ?= 20 200
BENCH_FLOWER_ROUNDS ?= 5

bench: $(STAMP)
	$(BIN)/python -m fedfew.bench --out $(BENCH_OUT) $(if $(TEST_DATA_DIR),--data-dir $(abspath $(TEST_DATA_DIR))) \
		--flower-clients $(BENCH_FLOWER_CLIENTS) --flower-rounds $(BENCH_FLOWER_ROUNDS) $(BENCH_ARGS)

slurm-up:
	bash scripts/slurm/install.sh && bash scripts/slurm/start.sh

slurm-down:
	bash scripts/slurm/stop.sh

clean:
	rm -rf outputs multirun .pytest_cache .hypothesis

# GPU readiness (issue #20, docs/speed.md). Here, where pip works:  make gpu-wheels gpu-data
# (wheels of what a bare torch image lacks + the CIFAR-10 tarballs, both git-ignored, carried to
# the GPU machine); there:  make gpu-check  (= bash scripts/gpu_check.sh; OUT=<dir> for the
# results). Without a GPU, gpu-check runs its CPU smoke mode (< 60 s; tests/test_gpu_check.py).
# GPU_WHEELS: the runtime dependencies a CUDA torch image (torch, torchvision, lightning,
# torchmetrics, transformers, numpy, scipy, scikit-learn, matplotlib, pandas, pillow, rich, pyyaml,
# pyarrow, ... preinstalled) may lack, each named and pinned to the versions tested here, for
# CPython 3.12 manylinux x86-64, without their dependencies. GPU_WHEELS_SDIST: pure-Python
# packages published only as source (antlr4-python3-runtime 4.9.3, omegaconf's parser runtime),
# built into a py3-none-any wheel here. wandb (~25 MB with its dependencies) is left out: add it
# with GPU_WHEELS_EXTRA when a run there needs logger=wandb.
GPU_WHEELS_DIR ?= .gpu_wheels
GPU_DATA_DIR ?= .gpu_data
GPU_WHEELS ?= hydra-core==1.3.8 omegaconf==2.3.1 submitit==1.5.4 hydra-submitit-launcher==1.2.0 \
	datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
GPU_WHEELS_SDIST ?= antlr4-python3-runtime==4.9.3
GPU_WHEELS_EXTRA ?=
GPU_PIP_TARGET := --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
	--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
GPU_CHECK_ARGS ?=

.PHONY: gpu-check gpu-wheels gpu-data

gpu-check:
	bash scripts/gpu_check.sh $(GPU_CHECK_ARGS)

# into $(GPU_WHEELS_DIR).tmp first: a failed download leaves the previous folder as it was
gpu-wheels:
	@set -e; tmp=$(GPU_WHEELS_DIR).tmp; trap 'rm -rf "$$tmp"' EXIT; rm -rf "$$tmp"; mkdir -p "$$tmp"; \
	echo "pip download $(GPU_WHEELS) $(GPU_WHEELS_EXTRA)"; \
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: $(GPU_PIP_TARGET) \
		-d "$$tmp" $(GPU_WHEELS) $(GPU_WHEELS_EXTRA); \
	echo "pip wheel $(GPU_WHEELS_SDIST)"; \
	$(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$$tmp" $(GPU_WHEELS_SDIST); \
	for w in "$$tmp"/*.whl; do case "$$w" in *-none-any.whl|*manylinux*x86_64.whl) ;; \
		*) echo "gpu-wheels: $$w is built for this machine, not for CPython 3.12 x86-64" >&2; exit 1;; esac; done; \
	rm -rf $(GPU_WHEELS_DIR); mv "$$tmp" $(GPU_WHEELS_DIR); ls $(GPU_WHEELS_DIR); du -sh $(GPU_WHEELS_DIR)

# the CIFAR-10 tarballs (~19 MB) from the data directory (DATA_DIR, FEDFEW_DATA_DIR or ../shared/data)
gpu-data:
	@src="$(TEST_DATA_DIR)/cifar10"; \
	if [ -z "$(TEST_DATA_DIR)" ] || [ ! -f "$$src/cifar10_train_jpg.tar.gz" ] || [ ! -f "$$src/cifar10_test_jpg.tar.gz" ]; then \
		echo "gpu-data: no cifar10_train_jpg.tar.gz + cifar10_test_jpg.tar.gz in '$$src'; set DATA_DIR=<data directory>" >&2; \
		exit 1; \
	fi; \
	set -e; tmp=$(GPU_DATA_DIR).tmp; trap 'rm -rf "$$tmp"' EXIT; rm -rf "$$tmp"; mkdir -p "$$tmp/cifar10"; \
	cp "$$src/cifar10_train_jpg.tar.gz" "$$src/cifar10_test_jpg.tar.gz" "$$tmp/cifar10/"; \
	rm -rf $(GPU_DATA_DIR); mv "$$tmp" $(GPU_DATA_DIR); du -sh $(GPU_DATA_DIR)
