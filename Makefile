# The README's commands. `make quickstart` and `make test` install everything on a fresh machine first.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install quickstart tiny test test-builds test-fast lint proto generate images compose-smoke cluster-e2e

install: $(VENV)/.installed

# torch is pinned and installed first: anything that depends on an unpinned torch would pull GBs of CUDA. vLLM's CPU
# build comes next, before the project (pyproject.toml [tool.reinforce.install.engines] says why).
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) scripts/install_system.py engines
	$(PY) -m pip install -q -e ".[dev,trackers,data,lora,megatron,dali,docs,api,openenv,reasoning]"
	$(PY) scripts/install_system.py
	touch $@

quickstart: install
	$(VENV)/bin/reinforce run examples/quickstart.yaml --overwrite

tiny: install
	$(VENV)/bin/reinforce run examples/tiny.yaml --overwrite

# Two pytest-xdist workers: one pytest process leaves much of 2 cores idle while tests wait on servers, pods and
# containers. tests/suite_plan.py plans them and fails a run past its time budget (docs/development.md).
test: install
	$(PY) -m pytest -n 2

# What the cluster, chart and compose tests of `make test` build: the Kubernetes binaries (from Debian's source
# package, into ~/.cache/reinforce-k8s) and every container image (~/.cache/reinforce-images and dockerd's layer
# cache). Each is built once per machine and found in its cache after; `make test` builds what is missing when a test
# first needs it. CI runs this first, timed apart from the tests. Needs root (apt, debootstrap, dockerd).
test-builds: install
	bash tests/integration/k8s-test-cluster.sh --node >/dev/null
	bash scripts/build-images.sh

# The quick loop: the unit tests and the integration tests that start no whole pipeline, API server, container or
# browser (under 5 minutes on 2 cores).
test-fast: install
	$(PY) -m pytest -n 2 -m "not slow and not cluster and not docker and not browser" tests/unit tests/integration

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

# Regenerate services/reinforce/core/records_pb2.py after editing proto/reinforce/v1/records.proto.
proto: install
	$(PY) -m grpc_tools.protoc -Iproto/reinforce/v1 --python_out=services/reinforce/core --pyi_out=services/reinforce/core records.proto

# Every generated file (CRD, chart values schema and RBAC rules, operator/operator.yaml, dashboards, alerts, the
# README's architecture picture, the docs' reference pages) from the code that defines it; the drift tests fail until
# this has been run.
generate: install
	PYTHONPATH=scripts $(PY) -m generate

# Every container image, offline: a debootstrapped Debian base, a wheelhouse, services/reinforce/*/Dockerfile (root, docker.io).
images:
	bash scripts/build-images.sh

# docker-compose.yml's stack in containers trains the tiny example to its end (tests/e2e/test_compose.py runs it too).
compose-smoke: install
	bash scripts/compose-smoke.sh

# helm install + kubectl apply on a real single-node cluster, with pods force-deleted mid-run (part of `make test`).
cluster-e2e: install
	$(PY) -m pytest -s tests/e2e/test_cluster_e2e.py
