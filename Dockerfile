FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY bus_redis ./bus_redis
COPY session_store ./session_store
COPY worker ./worker
COPY gateway ./gateway
RUN pip install --no-cache-dir '.[worker,gateway]'
USER nobody
ENTRYPOINT []
CMD ["agent-worker", "run"]
