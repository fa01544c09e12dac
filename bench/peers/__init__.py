"""One module per peer system; each exposes run_throughput(url, n, procs) and run_latency(url, n)."""
