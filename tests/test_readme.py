"""The README's Python examples run as written (all but the Ray launch, which tests/test_launch*.py cover)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


@pytest.mark.slow
def test_readme_examples_run(tmp_path, monkeypatch):
    blocks = python_blocks()
    runnable = [b for b in blocks if "al.launch(" not in b]
    assert len(blocks) >= 4 and len(runnable) == len(blocks) - 1, "README's example blocks changed: update this test"
    monkeypatch.chdir(tmp_path)  # the examples write plan.json
    scope: dict = {}
    for k, block in enumerate(runnable):
        exec(compile(block, f"README.md python block {k + 1}", "exec"), scope)
    assert (tmp_path / "plan.json").exists()
    assert len(scope["runner"].train(1)) == 1  # the pipeline the last block built keeps training
