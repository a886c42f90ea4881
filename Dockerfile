# rollserve's container image: `serving` on the model store /opt/ml/model, binding 0.0.0.0.
# docs/deploying.md, "Container image", has the build and run commands, SageMaker, and how tokens get in.
#
# Build arguments:
#   BASE_IMAGE     the runtime stage's base. The default is CPU and GPU alike: the CUDA builds of torch carry the
#                  CUDA runtime libraries as wheels, the host's NVIDIA Container Toolkit brings the driver
#                  (`docker run --gpus all`). A CUDA base image (nvidia/cuda:...-runtime-...) works when it carries
#                  the builder's CPython 3.11 at the same path (/usr/local/bin/python3.11): the venv is copied
#                  across and runs that interpreter. Give BUILDER_IMAGE the same value in that case.
#   BUILDER_IMAGE  the image the venv is built in (default python:3.11-slim-bookworm, as BASE_IMAGE).
#   TORCH_INDEX    the package index torch comes from, given to pip as --extra-index-url: PyTorch's CPU wheels by
#                  default; https://download.pytorch.org/whl/cu128 (or another cuXYZ) for a CUDA build.
#                  constraints/cpu.txt pins torch's version (2.13.0), the index picks the build (+cpu, +cu128).
# Nothing secret is built in: the server generates its tokens at start, or takes them from the environment or
# a mounted key file at run time.
ARG BASE_IMAGE=python:3.11-slim-bookworm
ARG BUILDER_IMAGE=python:3.11-slim-bookworm

FROM ${BUILDER_IMAGE} AS builder
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/venv
# Only what the package is built from (setup.cfg reads README.md as its long description).
COPY pyproject.toml setup.cfg README.md ./
COPY constraints/ constraints/
COPY rollcore/ rollcore/
COPY serving/ serving/
COPY handlers/ handlers/
RUN /opt/venv/bin/pip install --no-cache-dir --extra-index-url "${TORCH_INDEX}" -c constraints/cpu.txt .

FROM ${BASE_IMAGE}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# A C compiler: the engine builds its CPU kernels for the host's CPU at first use (-march=native, OpenMP; without
# one it runs slower PyTorch paths), and Triton builds its launcher with one on GPUs.
# hadolint ignore=DL3008 # unpinned: BASE_IMAGE may be Debian or Ubuntu, and one distribution's pin breaks the other
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
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
