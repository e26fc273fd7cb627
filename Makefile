# Set-up is two commands on a fresh machine with python3 and make: `make demo`, `make test`.
# Two virtual environments that never mix: .venv (data plane: torch, NVRx) and .venv-airflow
# (control plane: Airflow and its providers; no torch); a third, .venv-checkov, holds only the
# security scanner that `make lint-deploy` runs.
# `make test` also runs the training tests on NVRx 0.7 (test-nvrx07: tests/nvrx07/lane.sh), in a
# cached Debian testing root, because 0.7 does not install here. It needs root, debootstrap and
# zstd; without them it prints one line and skips.
PYTHON  ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
AFVENV  := .venv-airflow
AFBIN   := $(AFVENV)/bin
AFSTAMP := $(AFVENV)/.installed
# A third, for the security scanner alone: checkov pins packages Airflow pins differently.
CKVENV  := .venv-checkov
CKSTAMP := $(CKVENV)/.installed
PIP     := pip install --quiet --disable-pip-version-check

.PHONY: setup demo demo-training lint format reference test test-training test-nvrx07 kube-control-plane test-control lint-deploy bench bench-quick gpu-wheels gpu-check clean

setup: $(STAMP) $(AFSTAMP) $(CKSTAMP)

$(STAMP): pyproject.toml requirements/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/$(PIP) -c requirements/constraints.txt -e '.[training,dev]'
	touch $(STAMP)

$(AFSTAMP): pyproject.toml requirements/constraints-airflow.txt
	$(PYTHON) -m venv $(AFVENV)
	$(AFBIN)/$(PIP) -c requirements/constraints-airflow.txt -e '.[orchestration,dev,test-eks,test-deployment]'
	touch $(AFSTAMP)

$(CKSTAMP): requirements/checkov.txt
	$(PYTHON) -m venv $(CKVENV)
	$(CKVENV)/bin/$(PIP) -r requirements/checkov.txt
	touch $(CKSTAMP)

# The whole pipeline: Airflow stages real text, trains with a drill on every rung of the ladder
# (in-process, in-job, node replacement), evaluates and reports.
demo: $(STAMP) $(AFSTAMP)
	$(AFBIN)/python -m fsdp_resilience.control.demo

# Training alone, without Airflow: a local 2-rank run with one fault per restart layer.
demo-training: $(STAMP)
	$(BIN)/python -m fsdp_resilience.training.demo

# ruff: lint and format check, first (seconds). `make format` rewrites what the check reports.
lint: $(AFSTAMP)
	$(AFBIN)/ruff check .
	$(AFBIN)/ruff format --check .

format: $(AFSTAMP)
	$(AFBIN)/ruff check --fix .
	$(AFBIN)/ruff format .

# docs/reference/ is generated from the contract's code; a unit test fails when it is stale.
reference: $(STAMP)
	$(BIN)/python -m fsdp_resilience.training.contract.reference

test: lint test-training test-nvrx07 test-control lint-deploy

test-training: $(STAMP)
	$(BIN)/python -m pytest -q tests/training

# The training tests again on nvidia-resiliency-ext 0.7.0 (Python 3.14, Debian's CPU torch). The
# first run builds the root (a few minutes); later runs restore it from
# ~/.cache/fsdp-resilience in seconds. Pytest arguments: bash tests/nvrx07/lane.sh ARGS.
test-nvrx07:
	bash tests/nvrx07/lane.sh

# The Kubernetes control plane the EKS tests run against (tests/control/kube/build.sh): kube-apiserver,
# kube-controller-manager and kube-scheduler built from the Go module k8s.io/kubernetes, kwok, etcd.
# Built once (about 10 min on 2 cores; it prints how long), then reused from
# ~/.cache/fsdp-resilience/k8s-<hash of build.sh>. Without Go or the module proxy it prints one line
# and the EKS tests skip; with CI=true they fail instead. Then Karpenter's kwok cloud provider
# (tests/control/kube/build-karpenter.sh, about 5-6 min cold), the same way.
kube-control-plane:
	@rc=0; bash tests/control/kube/build.sh >/dev/null || rc=$$?; \
	if [ $$rc = 3 ] && [ "$${CI:-}" != true ]; then echo "kube: no control plane can be built here: the EKS tests skip"; \
	elif [ $$rc != 0 ]; then exit $$rc; fi
	@rc=0; bash tests/control/kube/build-karpenter.sh >/dev/null || rc=$$?; \
	if [ $$rc = 3 ] && [ "$${CI:-}" != true ]; then echo "kube: Karpenter cannot be built here: its tests skip"; \
	elif [ $$rc != 0 ]; then exit $$rc; fi

# The control plane's tests: Airflow, the local backend, and the EKS backend on the real Kubernetes
# control plane (Kubernetes 1.37); then the tests marked every_kube_version again on the same
# binaries emulating 1.35 (--emulated-version), the oldest minor in EKS standard support.
test-control: $(STAMP) $(AFSTAMP) kube-control-plane
	$(AFBIN)/python -m pytest -q tests/control
	KUBE_EMULATED_VERSION=1.35 $(AFBIN)/python -m pytest -q -m every_kube_version tests/control

# Benchmarks: JSON + plots in bench/results/, the table in README.md and docs/benchmarks.md. About
# 53 min on 2 cores: the training plane on NVRx 0.4.1 (stall, evaluation load, recovery with its
# torchrun and no-zygote baselines, spare takeover, node loss with the spares used up) 10 min, the
# NVRx 0.7 part (training_plane_nvrx07: the recovery rows, the spare takeover and the spares used
# up in the 0.7 lane's root, tests/nvrx07/lane.sh --bench; skipped where the lane cannot run) 7,
# the two chaos runs 17, the control plane 2, its 1,024-node scale part 17. bench-quick: a smoke
# run of the same scripts (about 7 minutes). Parts measured
# again: python -m bench.run --only PART[,PART] (merged into the committed figures).
bench: $(STAMP) $(AFSTAMP)
	$(AFBIN)/python -m bench.run

bench-quick: $(STAMP) $(AFSTAMP)
	$(AFBIN)/python -m bench.run --quick

# The training plane on a CUDA machine (every GPU it finds, NCCL): bf16 FSDP2, restarts in-process
# (one while a save is pending) and in-job, evaluation, the async checkpoint's stall, the 1b preset's
# memory; a PASS/FAIL line per check, docs/gpu.md and bench/results/gpu.json, within
# GPU_CHECK_LIMIT_S (docs/gpu.md). It runs under the GPU machine's own python3 and torch, which
# need no registry: `make gpu-wheels` first, on a machine with one, downloads NVRx 0.7.0 and what
# it and this project need besides torch (bench/gpu_check/wheels.txt, 27 MiB) for that machine's
# Python and glibc into build/gpu-wheels; gpu-check installs from there only what python3 lacks,
# into build/gpu-site. Without a GPU it checks its own wiring (make test runs that dry mode).
GPU_PYTHON         ?= python3
GPU_PYTHON_VERSION ?= 3.12
GPU_GLIBC          ?= 2.39
GPU_WHEELS         ?= build/gpu-wheels
GPU_SITE           := build/gpu-site
GPU_CHECK_LIMIT_S  ?= 450

gpu-wheels:
	$(PYTHON) bench/gpu_check/wheels.py download --dest $(GPU_WHEELS) \
		--python-version $(GPU_PYTHON_VERSION) --glibc $(GPU_GLIBC)

# src/ first: the tree's code, never a stale installed copy of it.
gpu-check:
	$(GPU_PYTHON) bench/gpu_check/wheels.py install --wheels $(GPU_WHEELS) --target $(GPU_SITE)
	PYTHONPATH="$(CURDIR)/src:$(CURDIR)/$(GPU_SITE)" $(GPU_PYTHON) -m bench.gpu_check --time-limit $(GPU_CHECK_LIMIT_S)

# The deployment kit alone (make test runs it): render every kustomization with kubectl's
# kustomize and validate each object, and each object the EKS backend creates, strictly against
# Kubernetes 1.30 and 1.37; lint the Dockerfiles; scan all three with checkov (deploy/scan.py:
# findings not in deploy/checkov-exceptions.yaml fail).
lint-deploy: $(AFSTAMP) $(CKSTAMP)
	$(AFBIN)/python deploy/render.py --check
	$(AFBIN)/python deploy/backend_objects.py --check
	$(AFBIN)/hadolint --failure-threshold style images/training/Dockerfile images/airflow/Dockerfile
	$(AFBIN)/python deploy/scan.py --checkov $(CKVENV)/bin/checkov

clean:
	rm -rf $(VENV) $(AFVENV) $(CKVENV) runs build *.egg-info .pytest_cache
