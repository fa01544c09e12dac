"""Benchmarks: omniflow against the queues a user would pick instead (see bench/README.md).

Kept import-free on purpose: `bench.common`, `bench.workload` and the peers are also
imported by the separate Celery virtualenv, which has neither numpy nor omniflow.
"""
