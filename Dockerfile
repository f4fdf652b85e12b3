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
# a worker container is healthy while some worker serves and no queue is stale
HEALTHCHECK --interval=15s --timeout=10s --start-period=20s --retries=3 \
  CMD ["agent-worker", "status", "--check", "--max-queue-age", "120"]
CMD ["agent-worker", "run"]
