# The hydraddp image: the MLflow server and the trainer nodes of docker-compose.yml run it (one image, built once).
# Build arguments, each with the default a user with Docker Hub wants:
# - BASE_IMAGE: any Debian-like image with Python 3.11 or 3.13 (what requires-python claims) and pip on PATH (scripts/compose_test.sh builds one locally).
# - TORCH_SPEC: torch first and pinned. On x86_64 Linux PyPI's torch is a CUDA build; pass a CPU wheel index for a
#   smaller image (--build-arg TORCH_SPEC="torch==2.13.0 --index-url <CPU wheel index>").
# - EXTRA_CA_CERTS: PEM certificates pip must trust besides the usual ones (a TLS-inspecting proxy's); empty: none.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
WORKDIR /app
ARG EXTRA_CA_CERTS=""
RUN if [ -n "$EXTRA_CA_CERTS" ]; then \
      printf '%s\n' "$EXTRA_CA_CERTS" > /usr/local/share/ca-certificates/build-extra.crt && update-ca-certificates; \
    fi
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir ${EXTRA_CA_CERTS:+--cert /etc/ssl/certs/ca-certificates.crt} $TORCH_SPEC
COPY pyproject.toml README.md ./
# The dependencies, in a layer that only pyproject.toml changes (installed through an empty package of that name): a
# change of the code rebuilds the layers below alone, in seconds, where it reinstalled every dependency (about 100 s).
# psycopg2 is the driver docker-compose.yml's backend store URI names (postgresql+psycopg2://).
RUN mkdir hydraddp && touch hydraddp/__init__.py \
    && pip install --no-cache-dir ${EXTRA_CA_CERTS:+--cert /etc/ssl/certs/ca-certificates.crt} . psycopg2-binary \
    && pip uninstall -q -y hydraddp && rm -rf hydraddp build hydraddp.egg-info
COPY hydraddp ./hydraddp
COPY conf ./conf
COPY experiments ./experiments
RUN pip install --no-cache-dir ${EXTRA_CA_CERTS:+--cert /etc/ssl/certs/ca-certificates.crt} --no-deps .
ENV PYTHONUNBUFFERED=1
CMD ["python", "-m", "hydraddp", "--help"]
