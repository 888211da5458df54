# syntax=docker/dockerfile:1
#
# The streamwarden sidecar image.
#
#   docker build -t streamwarden .
#   docker run --rm -p 8080:8080 -p 9090:9090 --read-only --tmpfs /tmp \
#       -e STREAMWARDEN_UPSTREAM=http://host.docker.internal:8000 streamwarden
#
# Runs as uid 10001 with a read-only root filesystem (it writes nothing
# outside /tmp). The config is /etc/streamwarden/config.yaml (the image ships
# configs/sidecar-in-front-of-app.yaml there; mount your own over it), and
# every key can be overridden with STREAMWARDEN_<KEY>. It runs on uvloop
# (installed here; STREAMWARDEN_EVENT_LOOP=asyncio for the standard loop).
# It installs the project's wheel, built and repaired in a stage with a C
# compiler, into a stage without one: the per-event modules run compiled.
# tests/project/test_container.py checks these properties and runs the same build
# and install steps and entrypoint without a Docker engine.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# The same Python on the same Debian, with a C compiler: the build compiles
# the per-event modules (setup.py, mypyc) into a wheel, and nothing after it
# has or needs a compiler.
ARG BUILD_IMAGE=python:3.11-bookworm

# -- build: the wheel, compiled and repaired to a manylinux tag ---------------
FROM ${BUILD_IMAGE} AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
# Only what the package build needs: pyproject.toml declares README.md as the
# long description, setup.py lists the compiled modules, and the code lives
# under src/. .ci/wheel is the build CI runs too.
COPY pyproject.toml setup.py README.md ./
COPY src ./src
COPY .ci/wheel .ci/wheel_check.py ./.ci/
# The build's requirements, from the lock: .ci/wheel builds with them.
COPY requirements/build.txt ./requirements/
# pip wheel, a check that the wheel holds every compiled module built from
# these sources, then auditwheel repair to the most compatible manylinux tag
# it satisfies: one wheel in /src/wheelhouse.
RUN bash .ci/wheel build /src/wheelhouse

# -- install: the wheel into a virtualenv, on the runtime's base (no compiler) --
FROM ${PYTHON_IMAGE} AS install

ENV PIP_DISABLE_PIP_VERSION_CHECK=1

COPY --from=build /src/wheelhouse /src/wheelhouse
# The dependencies from the lock, every file checked against its hash: the
# versions CI ran. They are the project's with the "fast" extra (uvloop and
# orjson) and "redis" (the shared resume store, resume_store: redis://...).
COPY requirements/image.txt /src/requirements/
# A virtualenv at the same path as in the runtime, so its scripts' shebangs
# hold. Binaries only: nothing may compile here, the dependencies come as
# wheels too. pip compiles every module to bytecode here, at build time, so
# the read-only runtime never needs to. The wheel itself goes in after its
# locked dependencies, adding none (pip check: none is missing). The build
# fails unless the compiled modules are what runs.
RUN python -m venv /opt/streamwarden \
    && /opt/streamwarden/bin/pip install --no-cache-dir --only-binary=:all: --require-hashes \
       -r /src/requirements/image.txt \
    && wheel="$(echo /src/wheelhouse/streamwarden-*.whl)" \
    && /opt/streamwarden/bin/pip install --no-cache-dir --only-binary=:all: --no-deps "${wheel}" \
    && /opt/streamwarden/bin/pip check \
    && version="$(/opt/streamwarden/bin/streamwarden --version)" \
    && echo "${version}" \
    && case "${version}" in *"per-event modules compiled"*) ;; *) exit 1 ;; esac

# -- runtime --------------------------------------------------------------------
# Debian slim, not distroless: on Kubernetes < 1.30 the Helm chart's preStop
# hook runs `sleep` inside this image.
FROM ${PYTHON_IMAGE}

LABEL org.opencontainers.image.title="streamwarden" \
      org.opencontainers.image.description="Keeps LLM token streams alive and honest: a streaming sidecar proxy" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed numeric uid/gid: Kubernetes' runAsNonRoot can only verify a
# numeric USER. No home directory and no shell: nothing runs as it but us.
RUN groupadd --system --gid 10001 streamwarden \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
       --home-dir /nonexistent --shell /usr/sbin/nologin streamwarden

COPY --from=install /opt/streamwarden /opt/streamwarden
# The default config (root-owned, read-only to the process): a sidecar in
# front of an app on 127.0.0.1:8000, listening on 8080 with admin on 9090.
COPY configs/sidecar-in-front-of-app.yaml /etc/streamwarden/config.yaml

# PYTHONDONTWRITEBYTECODE: never try to write .pyc files (the root filesystem
# may be read-only; they were compiled at build time). PYTHONUNBUFFERED: log
# lines leave at once, not when a buffer fills or at exit.
ENV PATH=/opt/streamwarden/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
# The only place that may be writable under --read-only (mount a tmpfs there).
WORKDIR /tmp

# 8080: the proxy (clients); 9090: admin (/metrics, /healthz, /readyz).
EXPOSE 8080 9090

# SIGTERM starts the drain: /readyz turns 503, no new connections, streams in
# flight get drain_timeout (25s) to finish, then a "shutting_down" error
# event; the process exits 0. A second signal exits at once.
STOPSIGNAL SIGTERM

# No curl in the slim image: ask /healthz with the standard library. The port
# follows STREAMWARDEN_ADMIN_LISTEN when it is set (else 9090); a port changed
# only in the config file needs this line changed too.
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('STREAMWARDEN_ADMIN_LISTEN', ':9090').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=2)"]

ENTRYPOINT ["streamwarden"]
CMD ["run", "--config", "/etc/streamwarden/config.yaml"]
