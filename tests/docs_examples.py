"""Run the code examples of the docs, so that a change of the API they show breaks a test."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[1] / "docs"


def docs_example(doc: str, defines: str) -> dict[str, Any]:
    """Run the one ```python block of docs/`doc` that defines `defines` (a class or a function) and
    return its namespace."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), re.S)
    found = [b for b in blocks if re.search(rf"^(class|def|async def) {re.escape(defines)}\b", b, re.M)]
    assert len(found) == 1, f"docs/{doc}: {len(found)} examples define {defines}"
    namespace: dict[str, Any] = {"__name__": f"docs_example_{defines}"}
    exec(compile(found[0], f"docs/{doc} ({defines})", "exec"), namespace)
    return namespace
