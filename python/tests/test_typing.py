"""The package is typed (PEP 561): py.typed ships, and the stub of the compiled extension names
exactly what the extension defines, with the same parameters."""

from __future__ import annotations

import ast
import inspect
import pathlib

import imagefeed
from imagefeed import _native

PACKAGE = pathlib.Path(imagefeed.__file__).parent


def stub() -> ast.Module:
    return ast.parse((PACKAGE / "_native.pyi").read_text())


def test_the_installed_package_is_marked_typed_and_ships_the_stub():
    assert (PACKAGE / "py.typed").is_file()
    assert (PACKAGE / "_native.pyi").is_file()


def test_the_stub_names_every_class_function_and_member_of_the_extension():
    module = stub()
    stubbed = {
        node.name: node for node in module.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))
    }
    # Every function and class, the private test helpers (`_augment_op`) too; not the dunders.
    public = {name for name in dir(_native) if not name.startswith("__")}
    assert set(stubbed) == public
    for name, node in stubbed.items():
        if not isinstance(node, ast.ClassDef):
            continue
        members = {item.name for item in node.body if isinstance(item, ast.FunctionDef)}
        actual = {m for m in vars(getattr(_native, name)) if not m.startswith("_")}
        assert {m for m in members if not m.startswith("_")} == actual, name


def parameters(node: ast.FunctionDef) -> list:
    names = [a.arg for a in node.args.args + node.args.kwonlyargs]
    return [n for n in names if n != "self"]


def test_the_stub_functions_and_methods_take_the_extensions_parameters():
    checked = 0
    for node in stub().body:
        if isinstance(node, ast.FunctionDef):
            actual = list(inspect.signature(getattr(_native, node.name)).parameters)
            assert parameters(node) == actual, node.name
            checked += 1
        elif isinstance(node, ast.ClassDef):
            cls = getattr(_native, node.name)
            for item in node.body:
                if not isinstance(item, ast.FunctionDef) or item.decorator_list:
                    continue  # properties have no parameters to compare
                target = cls if item.name == "__init__" else getattr(cls, item.name)
                try:
                    actual = list(inspect.signature(target).parameters)
                except ValueError:  # no text signature (a slot such as __len__)
                    continue
                assert parameters(item) == [a for a in actual if a != "self"], f"{node.name}.{item.name}"
                checked += 1
    assert checked >= 10
