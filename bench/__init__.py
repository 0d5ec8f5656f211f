"""tether benchmarks: ``python -m bench`` (see bench/README.md)."""
