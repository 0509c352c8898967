"""Request and step statistics, the periodic log line, and Prometheus metrics."""
