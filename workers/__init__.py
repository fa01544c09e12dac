"""Stage executors (installed as `omniflow.workers`), written against the contract in
`omniflow.executor`: `toy.py` holds the deterministic CPU omni stages used by the demo,
tests and benchmarks; `thinker.py`, `voice.py` and `vllm_omni.py` the real models.
`base.py` is the contract's old import path (it re-exports `omniflow.executor`)."""
