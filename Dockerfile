# syntax=docker/dockerfile:1.7
# ResilientJob: one image for the operator (`rjob operator`, the default command) and the worker agent
# (`agent`, what the operator runs in each worker pod through `python -m resilientjob.agent`).
#
#   CPU (default):  docker build -t resilientjob:dev .
#   CUDA:           docker build -t resilientjob:cuda \
#                     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#                     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   Ascend (NPU):   docker build -t resilientjob:ascend \
#                     --build-arg BASE_IMAGE=ascendai/cann:8.1.rc1-910b-ubuntu22.04-py3.11 \
#                     --build-arg TORCH_SPEC=torch==2.5.1 --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu \
#                     --build-arg TORCH_NPU_SPEC=torch-npu==2.5.1 .
#
# The builder and the runtime share BASE_IMAGE so that the virtual environment's interpreter and the
# accelerator libraries of the base (CUDA, CANN) match at run time.

ARG BASE_IMAGE=python:3.12-slim-bookworm

# ---- base: a Python >= 3.11 on whatever BASE_IMAGE provides ----------------------------------------------
FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# CUDA base images ship no Python; the python and CANN images do. Install one only where it is missing.
# The distribution's own python3 is what a given base has; pinning its version would break on other bases.
# hadolint ignore=DL3008
RUN if ! python3 -c 'import sys, venv; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then \
      apt-get update \
      && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# ---- builder: dependencies first (cached until pyproject.toml changes), then the package -----------------
FROM base AS builder
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_NPU_SPEC=""
RUN python3 -m venv "$VIRTUAL_ENV"
WORKDIR /src
# torch first, from the index that matches the base: a bare `torch` from PyPI is the multi-GB CUDA build.
# TORCH_SPEC and TORCH_NPU_SPEC are pinned by their build arguments (torch_npu must match torch exactly).
# hadolint ignore=DL3013
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple "$TORCH_SPEC" \
    && if [ -n "$TORCH_NPU_SPEC" ]; then pip install "$TORCH_NPU_SPEC"; fi
COPY pyproject.toml README.md ./
# The runtime dependencies alone, read from pyproject.toml, so editing the source keeps this layer.
RUN --mount=type=cache,target=/root/.cache/pip \
    python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
      > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt
COPY planner planner
COPY agent agent
COPY operator operator
COPY cli cli
COPY protocol protocol
# `rjob local` ships too; its extra (kmock, cel-python) does not: the image runs the operator and the agent.
COPY localstack localstack
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps . \
    && python3 -c 'import resilientjob.operator.handlers, resilientjob.agent.telemetry' \
    && find "$VIRTUAL_ENV" -name __pycache__ -type d -prune -exec rm -rf {} +

# ---- runtime: the virtual environment, an unprivileged user, nothing else --------------------------------
FROM base AS runtime
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="resilientjob" \
      org.opencontainers.image.description="ResilientJob operator and worker agent" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed numeric uid so that `runAsNonRoot` can be verified by the kubelet without a passwd lookup.
RUN groupadd --system --gid 10001 rjob \
    && useradd --system --uid 10001 --gid rjob --home-dir /home/rjob --create-home --shell /usr/sbin/nologin rjob
COPY --from=builder /opt/venv /opt/venv
COPY --chmod=0755 deploy/image/entrypoint.sh /usr/local/bin/rjob-entrypoint
# readOnlyRootFilesystem: everything that wants to write goes to /tmp (an emptyDir in the chart).
ENV HOME=/home/rjob \
    MPLCONFIGDIR=/tmp/matplotlib \
    XDG_CACHE_HOME=/tmp/cache \
    TORCH_HOME=/tmp/torch
USER 10001:10001
WORKDIR /home/rjob
EXPOSE 9090
ENTRYPOINT ["/usr/local/bin/rjob-entrypoint"]
CMD ["operator"]
