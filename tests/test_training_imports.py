"""The training side (every module of pipeline/ outside pipeline/orchestrate) imports neither the
store, the UI, gradio nor duckdb, and its modules import each other without cycles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINING = sorted(p.stem for p in (ROOT / "pipeline").glob("*.py") if p.stem not in ("__init__", "__main__"))
FORBIDDEN = ("store", "annotate", "gradio", "duckdb")

PROBE = """
import importlib, importlib.abc, sys
FORBIDDEN = {forbidden!r}

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in FORBIDDEN:
            raise ImportError(f"a training module imported {{name}}")
        return None

sys.meta_path.insert(0, Refuse())
for name in {modules!r}:
    importlib.import_module("pipeline." + name)
"""


def _probe(modules: list[str]) -> subprocess.CompletedProcess:
    code = PROBE.format(forbidden=FORBIDDEN, modules=modules)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_training_modules_import_no_store_ui_or_database():
    assert "train_ppo" in TRAINING and "orchestrate" not in TRAINING
    done = _probe(TRAINING)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_probe_catches_a_store_import(tmp_path):
    """The check itself: a module that imports the store fails it."""
    code = PROBE.format(forbidden=FORBIDDEN, modules=[]) + "import store\n"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "imported store" in done.stderr


def _pipeline_imports(name: str) -> set[str]:
    """Training modules that `name` imports, at the top or inside functions."""
    tree = ast.parse((ROOT / "pipeline" / f"{name}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "pipeline":
                found |= {a.name for a in node.names}
            elif node.module.startswith("pipeline."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("pipeline.")}
    return found & set(TRAINING)


def test_no_import_cycle_among_training_modules():
    graph = {name: _pipeline_imports(name) for name in TRAINING}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for dep in sorted(graph[node]):
            assert state.get(dep) != "open", f"import cycle: {' -> '.join(path + [node, dep])}"
            if dep not in state:
                visit(dep, path + [node])
        state[node] = "done"

    for name in TRAINING:
        if name not in state:
            visit(name, [])
