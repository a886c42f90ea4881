# syntax=docker/dockerfile:1
# rollserve's container image: `serving` on the model store /opt/ml/model, binding 0.0.0.0.
# docs/deploying.md, "Container image", has the build and run commands, SageMaker, and how tokens get in.
#
# Build arguments:
#   BASE_IMAGE     the runtime stage's base. The default is CPU and GPU alike: the CUDA builds of torch carry the
#                  CUDA runtime libraries as wheels, the host's NVIDIA Container Toolkit brings the driver
#                  (`docker run --gpus all`). A CUDA base image (nvidia/cuda:...-runtime-ubuntu24.04) works as the
#                  base of both stages: give BUILDER_IMAGE the same value. Each stage then installs the
#                  distribution's python3 (the builder with its venv module, the runtime with its headers, which
#                  Triton's launcher build needs), so the copied venv finds its interpreter at the same path; the
#                  runtime stage checks that it does and fails the build, saying so, when the stages differ.
#   BUILDER_IMAGE  the image the venv is built in (default python:3.11-slim-bookworm, as BASE_IMAGE).
#   TORCH_INDEX    the package index torch comes from, given to pip as --extra-index-url: PyTorch's CPU wheels by
#                  default; https://download.pytorch.org/whl/cu128 (or another cuXYZ) for a CUDA build.
#                  constraints/cpu.txt pins torch's version (2.13.0), the index picks the build (+cpu, +cu128).
#   WHEELS_DIR     a folder of the build context holding every wheel the install needs (`pip download` or
#                  `pip wheel` of `. -c constraints/cpu.txt`): the install then uses it alone (--no-index), for a
#                  build without network access. Empty (default): the package indexes.
# Nothing secret is built in: the server generates its tokens at start, or takes them from the environment or
# a mounted key file at run time.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG BUILDER_IMAGE=python:3.11-slim-bookworm

FROM ${BUILDER_IMAGE} AS builder
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS_DIR=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
# A base without Python (a CUDA image): the distribution's, which the runtime stage installs alike.
# hadolint ignore=DL3008 # unpinned: BUILDER_IMAGE may be Debian or Ubuntu, and one distribution's pin breaks the other
RUN if ! command -v python3 >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv
# Only what the package is built from (setup.cfg reads README.md as its long description).
COPY pyproject.toml setup.cfg README.md ./
COPY constraints/ constraints/
COPY rollcore/ rollcore/
COPY serving/ serving/
COPY handlers/ handlers/
# WHEELS_DIR mounted read-only for the install alone (docker/ when none is given: no wheels there, not read)
RUN --mount=type=bind,source=${WHEELS_DIR:-docker},target=/wheels \
    if [ -n "${WHEELS_DIR}" ]; then \
        /opt/venv/bin/pip install --no-cache-dir --no-index --find-links /wheels -c constraints/cpu.txt .; \
    else \
        /opt/venv/bin/pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" -c constraints/cpu.txt .; \
    fi

FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A C compiler: the engine builds its CPU kernels for the host's CPU at first use (-march=native, OpenMP; without
# one it runs slower PyTorch paths), and Triton builds its launcher with one on GPUs.
# A base without Python (a CUDA image, as BUILDER_IMAGE): the distribution's python3, where the builder's venv
# expects it, with its headers for Triton.
# hadolint ignore=DL3008 # unpinned: BASE_IMAGE may be Debian or Ubuntu, and one distribution's pin breaks the other
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! command -v python3 >/dev/null; then apt-get install -y --no-install-recommends python3 python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*
# A fixed, non-root UID (1000) that owns /opt/ml (the model store), the working directory, where the server
# writes key_file.json (mode 0600, removed at shutdown), and ~/.cache (models fetched from a hub, PyPI or S3, and
# the built kernels; a volume mounted there starts with this owner). Ubuntu bases have a user 1000: it gives way.
RUN if getent passwd 1000 >/dev/null; then userdel --remove "$(getent passwd 1000 | cut -d: -f1)"; fi \
    && if getent group 1000 >/dev/null; then groupdel "$(getent group 1000 | cut -d: -f1)"; fi \
    && groupadd --gid 1000 rollserve \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/rollserve --shell /usr/sbin/nologin rollserve \
    && mkdir -p /opt/ml/model /opt/rollserve /home/rollserve/.cache \
    && chown -R 1000:1000 /opt/ml /opt/rollserve /home/rollserve
COPY --from=builder /opt/venv /opt/venv
# The copied venv runs the interpreter it was built with, at the same path: stop here when this base lacks it
RUN /opt/venv/bin/python -c "import serving" \
    || { echo "the venv's interpreter ($(readlink /opt/venv/bin/python)) does not run on BASE_IMAGE: build both" \
              "stages from one image (BUILDER_IMAGE = BASE_IMAGE)" >&2; exit 1; }
COPY docker/healthcheck.py /opt/rollserve/healthcheck.py
# The server's keys through its SERVING_<KEY> variables (serving.config.server_config): every listener on all interfaces
# at its default port, and SageMaker's model directory as the model store. These hold for `serve` too (SageMaker
# replaces CMD). Inference needs the inference token on a non-loopback address (inference_auth=auto).
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    SERVING_INFERENCE_ADDRESS=http://0.0.0.0:8080 \
    SERVING_MANAGEMENT_ADDRESS=http://0.0.0.0:8081 \
    SERVING_GRPC_ADDRESS=0.0.0.0:8001 \
    SERVING_MODEL_STORE=/opt/ml/model
WORKDIR /opt/rollserve
USER 1000:1000
# inference (SageMaker's port), management (and /metrics), gRPC
EXPOSE 8080 8081 8001
VOLUME ["/opt/ml/model"]
# Liveness: a server whose model is still loading is alive (/ping is readiness, which SageMaker probes itself).
HEALTHCHECK --interval=30s --timeout=10s --start-period=30s --retries=3 \
    CMD ["/opt/venv/bin/python", "/opt/rollserve/healthcheck.py"]
ENTRYPOINT ["serving"]
CMD ["--model-store", "/opt/ml/model"]
