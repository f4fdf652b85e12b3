"""Operations: Prometheus metrics, the health endpoints, log formatting."""
