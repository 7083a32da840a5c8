# syntax=docker/dockerfile:1.7
# The learner image: PyTorch + the offpolicy distribution, one process (`offpolicy learner`), non-root.
# Targets: `gpu` (the default: the actors' official vLLM image, so that the learner has the vLLM whose
# weight-transfer engines `publish.transport: vllm` drives and the same torch and NCCL as the actors it
# shares a communicator with) and `cpu` (Python slim + the CPU build of torch the tests run, used by
# docker-compose.cpu.yml; tests/unit/deploy/test_images.py keeps the pins equal). Build from the root:
#   docker build -f deploy/docker/learner.Dockerfile -t offpolicy/learner:0.1.0 .
#   docker build -f deploy/docker/learner.Dockerfile --target cpu -t offpolicy/learner-cpu:0.1.0 .
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

# --- cpu: the same learner on the CPU build of torch (docker-compose.cpu.yml, the tiny model)
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_CPU_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OFFPOLICY_HOST=0.0.0.0 OFFPOLICY_PORT=8000 HF_HOME=/var/lib/offpolicy/hf-cache
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
      "torch==${TORCH_CPU_VERSION}+cpu" /wheels/offpolicy-*.whl "tensorboard>=2.14,<3" "wandb>=0.20,<1" \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/offpolicy offpolicy \
 && mkdir -p /var/lib/offpolicy/weights /var/lib/offpolicy/checkpoints /var/lib/offpolicy/logs /var/lib/offpolicy/hf-cache /var/lib/offpolicy/models \
      /var/lib/offpolicy/tiny-model \
 && chown -R 10001:10001 /var/lib/offpolicy
COPY --chmod=0644 deploy/docker/healthcheck.py /usr/local/lib/offpolicy/healthcheck.py
USER 10001:10001
WORKDIR /var/lib/offpolicy
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
  CMD ["python", "/usr/local/lib/offpolicy/healthcheck.py"]
ENTRYPOINT ["offpolicy"]
CMD ["learner", "--config", "/etc/offpolicy/learner.yaml"]

# --- gpu (default target): the actors' vLLM image (torch, CUDA, NCCL and vLLM as the actors have them; the
# driver comes from the host through the NVIDIA container toolkit), plus the RDMA user space NCCL needs for
# InfiniBand / RoCE between nodes (without it NCCL falls back to TCP sockets). NCCL_M2N_SPEC: the pip
# requirement of NVIDIA's nccl.m2n extension for `transfer.backend: nccl_m2n` (empty: not installed).
# Expandable segments: fewer fragmentation OOMs as micro-batch shapes vary.
FROM ${VLLM_IMAGE} AS gpu
ARG NCCL_M2N_SPEC=""
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    OFFPOLICY_HOST=0.0.0.0 OFFPOLICY_PORT=8000 HF_HOME=/var/lib/offpolicy/hf-cache \
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
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
# hadolint ignore=DL3013
RUN --mount=type=bind,from=wheel,source=/wheels,target=/wheels \
    python3 -m pip install --no-cache-dir /wheels/offpolicy-*.whl "tensorboard>=2.14,<3" "wandb>=0.20,<1" \
 && if [ -n "${NCCL_M2N_SPEC}" ]; then python3 -m pip install --no-cache-dir "${NCCL_M2N_SPEC}"; fi \
 && useradd --uid 10001 --user-group --no-create-home --home-dir /var/lib/offpolicy offpolicy \
 && mkdir -p /var/lib/offpolicy/weights /var/lib/offpolicy/checkpoints /var/lib/offpolicy/logs /var/lib/offpolicy/hf-cache /var/lib/offpolicy/models \
 && chown -R 10001:10001 /var/lib/offpolicy
COPY --chmod=0644 deploy/docker/healthcheck.py /usr/local/lib/offpolicy/healthcheck.py
USER 10001:10001
WORKDIR /var/lib/offpolicy
EXPOSE 8000 29600
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python3", "/usr/local/lib/offpolicy/healthcheck.py"]
ENTRYPOINT ["offpolicy"]
CMD ["learner", "--config", "/etc/offpolicy/learner.yaml"]
