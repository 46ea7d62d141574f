# syntax=docker/dockerfile:1
# kvtierd daemon image (CPU tiers; the CUDA variant is described in README, "Operating kvtierd").
#   docker build -t kvtierd:0.1.0 .
#   docker run --rm --shm-size=10g --ulimit memlock=-1 -v kvtierd-run:/run/kvtierd \
#     -e KVTIERD_CPU_BYTES=8GiB kvtierd:0.1.0
# Configuration: the image's file /etc/kvtierd/kvtierd.toml (deploy/docker/kvtierd.toml: socket and
# metrics address) or yours mounted over it, then KVTIERD_* variables and flags you pass. The image
# sets no KVTIERD_* variable but KVTIERD_CONFIG, so nothing hidden overrides a mounted file.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The wheel is built where a C compiler is (the full image of the same Python and Debian release):
# setup.py's kvtierd.copy._ranges, the GIL-free copy loop of small-chunk jobs. The slim image has
# none, and the build would go on without it (it is optional), leaving the daemon slower.
ARG BUILD_IMAGE=python:3.11-bookworm

FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvtierd ./kvtierd
COPY client ./client
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
# The daemon's own dependencies: pyproject's [project] dependencies less the engine-side torch and
# numpy, which the daemon never imports (tests/deploy/test_dockerfile.py keeps the two in step and
# runs the daemon from exactly this set).
COPY --from=build /wheels /wheels
RUN python -m venv /opt/kvtierd \
    && /opt/kvtierd/bin/pip install --no-cache-dir \
        "pyzmq>=25" "msgpack>=1.0" "prometheus-client>=0.20" "xxhash>=3.0" \
    && /opt/kvtierd/bin/pip install --no-cache-dir --no-deps /wheels/kvtierd-*.whl \
    && rm -rf /wheels \
    && groupadd --system --gid 10001 kvtierd \
    && useradd --system --uid 10001 --gid kvtierd --no-create-home --shell /usr/sbin/nologin kvtierd \
    && mkdir -p /run/kvtierd /var/lib/kvtierd /etc/kvtierd \
    && chown kvtierd:kvtierd /run/kvtierd /var/lib/kvtierd \
    && chmod 0750 /run/kvtierd /var/lib/kvtierd

COPY deploy/docker/kvtierd.toml /etc/kvtierd/kvtierd.toml
ENV PATH=/opt/kvtierd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    XDG_STATE_HOME=/var/lib \
    KVTIERD_CONFIG=/etc/kvtierd/kvtierd.toml
USER 10001:10001
VOLUME ["/run/kvtierd", "/var/lib/kvtierd"]
EXPOSE 9464
STOPSIGNAL SIGTERM
# PING through the daemon's own socket; the start period covers prefaulting a large arena.
HEALTHCHECK --interval=10s --timeout=5s --start-period=5m --retries=3 \
    CMD ["kvtierd", "ping", "--timeout", "3"]
# umask 0007: the socket is group-writable, so engines in the kvtierd group (gid 10001) may connect.
ENTRYPOINT ["/bin/sh", "-c", "umask 0007 && exec kvtierd serve \"$@\"", "kvtierd"]
