"""Stage executors (installed as `omniflow.workers`): `base.py` is the plugin protocol,
`toy.py` the deterministic CPU omni stages used by the demo, tests and benchmarks."""
