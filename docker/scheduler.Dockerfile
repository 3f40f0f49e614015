# kvgrid scheduler: request queues, KV block manager, prefix cache (gRPC 50052, /metrics on 8002).
# Pure Python over plain data: core dependencies only, no torch, no model files.
#   docker build -f docker/scheduler.Dockerfile -t kvgrid-scheduler:0.1.0 .
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
RUN python -m venv /opt/kvgrid
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvgrid ./kvgrid
COPY services ./services
COPY kernels ./kernels
RUN /opt/kvgrid/bin/pip install .

FROM ${PYTHON_IMAGE}
# tini as PID 1 forwards SIGTERM to kvgrid, which drains its streams before exiting
RUN apt-get update && apt-get install -y --no-install-recommends tini && rm -rf /var/lib/apt/lists/* \
 && useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin kvgrid
COPY --from=build /opt/kvgrid /opt/kvgrid
ENV PATH=/opt/kvgrid/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    KVGRID_HOST=0.0.0.0 \
    KVGRID_SCHEDULER_PORT=50052 \
    KVGRID_SCHEDULER_METRICS_PORT=8002
USER 10001:10001
WORKDIR /home/kvgrid
EXPOSE 50052 8002
# SERVING only after a successful handshake with its worker
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-m", "kvgrid.cli.healthcheck", "localhost:50052"]
ENTRYPOINT ["/usr/bin/tini", "--"]
CMD ["kvgrid", "scheduler"]
