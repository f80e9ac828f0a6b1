"""What operators watch: Prometheus metrics and request-scoped logs."""
