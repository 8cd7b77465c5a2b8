"""The latency dashboard: the durable turn store, its figures, its APIs, /metrics."""
