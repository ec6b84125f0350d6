# The hydraddp image: the trainer nodes and the MLflow server of docker-compose.yml run it.
FROM python:3.11-slim
WORKDIR /app
# torch first and pinned. On x86_64 Linux PyPI's torch is a CUDA build; pass a CPU wheel index in
# TORCH_SPEC (e.g. --build-arg TORCH_SPEC="torch==2.13.0 --index-url <CPU wheel index>") for a smaller image.
ARG TORCH_SPEC="torch==2.13.0"
RUN pip install --no-cache-dir $TORCH_SPEC
COPY pyproject.toml README.md ./
COPY hydraddp ./hydraddp
COPY conf ./conf
COPY experiments ./experiments
# psycopg2 lets the MLflow server use the PostgreSQL backend store.
RUN pip install --no-cache-dir . psycopg2-binary
ENV PYTHONUNBUFFERED=1
CMD ["python", "-m", "hydraddp", "--help"]
