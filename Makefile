# nailseg — every target installs what it needs first (a no-op when .venv is up to date).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DATASET ?= synthetic
# make train's preset: experiment=cpu (sized for 2 cores) where torch sees no GPU, else the defaults
TRAIN_PRESET ?= $(shell $(PY) -c 'from nailseg.device import auto_accelerator as a; print("experiment=cpu" * (a() == "cpu"))')
REAL_DATA ?= ../shared/data/nails
BENCH_DIR ?= outputs/bench
ARGS ?=
CROSS_DIR ?= outputs/cross-source
HOLDOUT ?= 1 2
CROSS_AUGS ?= light,heavy,geometric,robust,photo
CROSS_DATASETS ?= nails,nails_synthetic
# rows beside the dataset x aug grid, each over the held-out roots (':' joins a row's overrides):
# the synthetic photos alone, the mix at weight 3, the wild preset (a row's overrides win over ARGS)
CROSS_ROWS ?= dataset=nails_synthetic:dataset.weight=0:aug=photo dataset=nails_synthetic:dataset.mix.0.weight=3:aug=photo dataset=nails:experiment=wild
SYNTHETIC_N ?=
TARGET ?= 0.95
# one process per setting (start-up counts), each a one-job sweep into TTT_DIR, whose end prints
# the compare table of the jobs so far; ':' joins the overrides of one setting
TTT_SETTINGS ?= experiment=gpu_384 experiment=fast_384 experiment=fast_384:dataset.image_size=[256,256]
TTT_SEEDS ?= 42
comma := ,
empty :=
space := $(empty) $(empty)

.PHONY: help install prepare train test test-quick lint format bench-prepare bench-predict bench-zoomed bench bench-scale bench-ddp compare cross-source time-to-target gpu-check clean

help:  ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/:.*## /\t/' | expand -t 16

install: $(STAMP)  ## create .venv with the pinned packages (a no-op when it is up to date)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

prepare: install  ## images + masks -> npy + CSV for DATASET (synthetic: generated first)
	$(PY) prepare.py dataset=$(DATASET) $(ARGS)

train: install  ## prepare DATASET, then train on it (TRAIN_PRESET: experiment=cpu where no GPU is seen)
	$(PY) prepare.py dataset=$(DATASET)
	$(PY) train.py dataset=$(DATASET) $(TRAIN_PRESET) $(ARGS)

# a file's tests (and its shared fixtures) in one process, one thread each; the whole suite runs
# one process more than the cores (many of its tests wait on subprocesses of their own)
PYTEST := HF_HUB_OFFLINE=1 WANDB_MODE=offline OMP_NUM_THREADS=1 $(PY) -m pytest --dist loadfile

test: install  ## the whole suite, README's commands and CI's (real-data tests skip where ../shared is absent)
	$(PYTEST) -n $(shell echo $$(( $$(nproc) + 1 ))) $(ARGS)

test-quick: install  ## the inner loop (about a minute): every module's core behaviour, no slow or real-data test
	$(PYTEST) -n $(shell nproc) -m "not slow and not real_data" $(ARGS)

lint: install  ## ruff check and format --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install  ## ruff fix and format
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

bench-prepare: install  ## prepare of the real pairs, cold and rerun; synthetic generation speed
	$(PY) -m benchmarks.prepare input_dir=$(REAL_DATA) output_dir=$(BENCH_DIR)/prepare $(ARGS)

clean:  ## remove what nailseg provably wrote (runs, sweeps, synthetic sets) and the tool caches; names what it keeps
	$(PY) -m nailseg.io.clean

bench-predict: install  ## predict's photos/s on photos made from REAL_DATA (GPU decode or not, CPU) and ONNX Runtime vs PyTorch on the CPU; CKPT=checkpoint
	$(PY) -m benchmarks.predict ckpt=$(CKPT) input_dir=$(REAL_DATA)/Images output_dir=$(BENCH_DIR)/predict $(ARGS)

bench-zoomed: install  ## Dice of predict's default and fixed tile sizes on REAL_DATA's validation photos zoomed out onto larger canvases, and as they are; CKPT=checkpoint
	$(PY) -m benchmarks.zoomed ckpt=$(CKPT) input_dir=$(REAL_DATA) output_dir=$(BENCH_DIR)/zoomed $(ARGS)

bench: install  ## loader comparison: torch / kornia / dali x light / heavy, with the resident ceiling
	$(PY) -m nailseg bench output_dir=$(BENCH_DIR)/loaders $(ARGS)

bench-scale: install  ## generate, prepare and a loader epoch at 1k, 10k, 100k synthetic photos: photos/s and peak memory per count
	$(PY) -m benchmarks.scale output_dir=$(BENCH_DIR)/scale $(ARGS)

ifndef COMPARE_DIR
COMPARE_DIR := multirun/compare-$(shell date +%Y%m%d-%H%M%S)
endif
compare: install  ## train once per loader x aug (one W&B group), then a table and plot of the sweep
	$(PY) prepare.py dataset=$(DATASET)
	$(PY) train.py -m dataset=$(DATASET) loader=torch,kornia,dali aug=light,heavy \
		hydra.sweep.dir=$(COMPARE_DIR) $(ARGS)
	$(PY) -m nailseg compare sweep_dir=$(COMPARE_DIR)

ifndef DDP_DIR
DDP_DIR := multirun/ddp-$(shell date +%Y%m%d-%H%M%S)
endif
bench-ddp: install  ## DDP scaling on REAL_DATA: one GPU, then DDP on every GPU (ledger on), a table with scaling efficiency (GPUs)
	$(PY) prepare.py dataset=nails input_dir=$(REAL_DATA) output_dir=outputs/bench-ddp/data
	$(PY) train.py -m experiment=gpu_384 dataset=nails dataset.root=outputs/bench-ddp/data \
		trainer=gpu,ddp callbacks=audit test=false logger=csv hydra.sweep.dir=$(DDP_DIR) $(ARGS)
	$(PY) -m nailseg compare sweep_dir=$(DDP_DIR)

cross-source: install  ## leave-one-source-out on REAL_DATA: per held-out group x dataset x aug, then CROSS_ROWS; a table + plot (GPU: ARGS=experiment=gpu_384)
	for g in $(HOLDOUT); do \
		$(PY) prepare.py dataset=nails input_dir=$(REAL_DATA) output_dir=$(CROSS_DIR)/holdout-$$g \
			"split.holdout_groups=[$$g]" || exit 1; \
	done
	$(PY) prepare.py dataset=synthetic_mix $(if $(SYNTHETIC_N),dataset.synthetic.n=$(SYNTHETIC_N))
	$(PY) train.py -m dataset=$(CROSS_DATASETS) \
		dataset.root=$(subst $(space),$(comma),$(HOLDOUT:%=$(CROSS_DIR)/holdout-%)) \
		aug=$(CROSS_AUGS) hydra.sweep.dir=$(CROSS_DIR)/sweep $(ARGS)
	set -f; n=0; for r in $(CROSS_ROWS); do n=$$((n+1)); \
		$(PY) train.py -m $(ARGS) $$(echo $$r | tr ':' ' ') \
			dataset.root=$(subst $(space),$(comma),$(HOLDOUT:%=$(CROSS_DIR)/holdout-%)) \
			hydra.sweep.dir=$(CROSS_DIR)/sweep 'hydra.sweep.subdir=row'$$n'-$${hydra.job.num}' || exit 1; \
	done
	$(PY) -m nailseg compare sweep_dir=$(CROSS_DIR)/sweep

ifndef TTT_DIR
TTT_DIR := outputs/time-to-target/$(shell date +%Y%m%d-%H%M%S)
endif
time-to-target: install  ## seconds from process start to val Dice >= TARGET on REAL_DATA, per setting of TTT_SETTINGS and seed of TTT_SEEDS (GPU); a table + plot
	$(PY) prepare.py dataset=nails input_dir=$(REAL_DATA) output_dir=outputs/time-to-target/data
	set -f; n=0; for s in $(TTT_SETTINGS); do for seed in $(TTT_SEEDS); do n=$$((n+1)); \
		$(PY) train.py -m dataset=nails dataset.root=outputs/time-to-target/data $$(echo $$s | tr ':' ' ') \
			seed=$$seed callbacks.time_to_target.target=$(TARGET) callbacks.time_to_target.stop=true \
			test=false logger=csv hydra.sweep.dir=$(TTT_DIR) hydra.sweep.subdir=$$n $(ARGS) || exit 1; \
	done; done

gpu-check:  ## every GPU test (DALI GPU pairing and counts, short fits, bench); PY=python3 where no .venv
	$(PY) -m pytest -m gpu tests/test_gpu.py tests/data/test_dali_loader.py $(ARGS)
