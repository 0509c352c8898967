"""The code's shape is checked with the tests: no import circles (imports inside
functions included), no import against the layering, no function over 80 lines
without a docstring saying why (tools/code_report.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def code_report():
    spec = importlib.util.spec_from_file_location("code_report", ROOT / "tools" / "code_report.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["code_report"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["code_report"]


def test_heron_keeps_its_layering_and_has_no_import_circles(code_report):
    assert code_report.check() == []


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, source in files.items():
        path = tmp_path / "heron" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path / "heron"


def test_the_check_catches_circles_wrong_way_imports_and_long_functions(code_report, tmp_path):
    """Planted faults are found: a circle closed by an import inside a function,
    a core module importing the engine, and 81-line functions (one defined under
    an ``if``, as Triton kernels are)."""
    long_body = "\n".join(f"    x{i} = {i}" for i in range(80))
    package = _package(tmp_path, {
        "__init__.py": "",
        "config.py": "",
        "core/__init__.py": "",
        "core/scheduler.py": "from heron.engine import core\n",
        "engine/__init__.py": "",
        "engine/core.py": "def f():\n    from heron.engine import llm\n",
        "engine/llm.py": "from heron.engine.core import f\n",
        "models/__init__.py": "",
        "models/llama.py": f"def forward():\n{long_body}\n",
        "models/short.py": f'def justified():\n    """Kept as one piece: it is a kernel."""\n{long_body}\n',
        "models/kernels.py": "if True:\n\n    def under_if():\n" + long_body.replace("\n", "\n    ").replace(
            "    x0", "        x0", 1) + "\n",
    })
    problems = code_report.check(package)
    assert "import circle: heron.engine.core <-> heron.engine.llm" in problems
    assert "wrong-way import: heron.core.scheduler -> heron.engine.core" in problems
    assert any("forward is 81 lines" in p for p in problems)
    assert any("under_if is 81 lines" in p for p in problems)  # a function under an `if` counts too
    assert not any("justified" in p for p in problems)
    assert len(problems) == 4, problems
