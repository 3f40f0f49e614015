# syntax=docker/dockerfile:1
# kvgrid scheduler: request queues, KV block manager, prefix cache (gRPC 50052, /metrics on 8002).
# Pure Python over plain data: core dependencies only, no torch, no model files.
#   docker build -f docker/scheduler.Dockerfile -t kvgrid-scheduler .
ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
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
