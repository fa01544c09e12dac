"""The lifecycle contracts of DESIGN §1 (tests/test_contracts.py), unchanged, against a real Valkey
Cluster of three primaries: the engine detects the cluster from one node's URL and spreads
workflows over 16 cells (the `valkey_url` fixture of this directory is the cluster)."""
from __future__ import annotations

from test_contracts import *  # noqa: F403 - the same tests, collected again here
