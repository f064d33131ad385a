# SPDX-License-Identifier: Apache-2.0
"""The type stubs (_sheaf.pyi) describe what the native module has."""

from __future__ import annotations

import ast
import inspect
import pathlib

import sheaf
from sheaf import _sheaf


def stub_tree() -> ast.Module:
    path = pathlib.Path(inspect.getfile(sheaf)).with_name("_sheaf.pyi")
    return ast.parse(path.read_text())


def test_stubs_match_native_module() -> None:
    tree = stub_tree()
    stubbed: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            assert callable(getattr(_sheaf, node.name)), node.name
        elif isinstance(node, ast.ClassDef):
            stubbed[node.name] = {
                f.name for f in node.body if isinstance(f, ast.FunctionDef)
            }
    native = {n for n, v in vars(_sheaf).items() if isinstance(v, type)}
    assert native == set(stubbed), native ^ set(stubbed)
    for cls, members in stubbed.items():
        have = {m for m in dir(getattr(_sheaf, cls)) if not m.startswith("__")}
        declared = {m for m in members if not m.startswith("__")}
        assert declared == have, (cls, declared ^ have)


def test_package_is_typed() -> None:
    assert pathlib.Path(inspect.getfile(sheaf)).with_name("py.typed").exists()
