"""Prometheus metrics of a worker and of the dashboard (docs/monitoring.md).

hooks.py is what the worker's code calls (a no-op until a worker with --metrics-port installs
its WorkerMetrics); worker.py defines the worker's metrics; queue_state.py reads the
database's side at each scrape; labels.py bounds the label values; serve.py is the endpoint.
"""
