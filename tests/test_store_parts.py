"""The Store's parts (the classes of store/*.py, one module each: QueueMixin, RankingsMixin, ...)
reach each other only through public methods: a method may use a private method (`self._name`) of
its own module or of the core every part builds on (store/db.py StoreBase), never one defined only
in another part's module. Two parts that use each other's private methods are one class in two
halves, and a change to one half breaks the other unseen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = "db"
"""The module of StoreBase: its private methods (transactions, cursors, bulk inserts) are the core
every part uses."""


def _private_methods(tree: ast.Module) -> set[str]:
    """Names of the private methods (`_name`, not dunders) defined in the module's classes."""
    return {fn.name for cls in tree.body if isinstance(cls, ast.ClassDef) for fn in cls.body
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            and fn.name.startswith("_") and not fn.name.startswith("__")}


def _self_uses(tree: ast.Module):
    """(class, method, attribute, line) for each `self._name` read inside a method of a class."""
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
                        and node.attr.startswith("_") and not node.attr.startswith("__")):
                    yield cls.name, fn.name, node.attr, node.lineno


def private_uses_across_parts(sources: dict[str, str]) -> list[str]:
    """For {module name: source} of store/: each method that uses a private method defined only in
    another module than its own and the core, as 'module.Class.method uses other._name (line n)'."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    defined: dict[str, set[str]] = {}  # private method -> modules that define it
    for name, tree in trees.items():
        for method in _private_methods(tree):
            defined.setdefault(method, set()).add(name)
    problems = []
    for name, tree in sorted(trees.items()):
        for cls, fn, attr, line in _self_uses(tree):
            where = defined.get(attr, set())
            if where and name not in where and CORE not in where:
                problems.append(f"{name}.{cls}.{fn} uses {'/'.join(sorted(where))}.{attr} (line {line})")
    return problems


def test_no_store_part_uses_another_parts_private_method():
    sources = {p.stem: p.read_text(encoding="utf-8") for p in sorted((ROOT / "store").glob("*.py"))}
    assert {"queue", "rankings", "repo", CORE} <= set(sources)
    problems = private_uses_across_parts(sources)
    assert problems == [], "\n".join(problems)


def test_the_check_catches_a_private_method_of_another_part():
    """The check itself: a call into another part's private method, or a reference to it, fails it;
    the part's own private methods and the core's pass."""
    sources = {
        "db": "class StoreBase:\n    def _tx(self):\n        pass\n",
        "queue": "class QueueMixin:\n    def _pick(self):\n        pass\n",
        "rankings": ("class RankingsMixin:\n"
                     "    def save(self):\n"
                     "        self._tx()\n"
                     "        self._own()\n"
                     "        return self._pick()\n"
                     "    def later(self):\n"
                     "        return self._combined(self._pick)\n"
                     "    def _own(self):\n"
                     "        pass\n"),
    }
    assert private_uses_across_parts(sources) == ["rankings.RankingsMixin.save uses queue._pick (line 5)",
                                                  "rankings.RankingsMixin.later uses queue._pick (line 7)"]
