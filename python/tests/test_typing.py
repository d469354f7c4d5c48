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


def _keys_fit(report, shape, what):
    """The report has every required key of its TypedDict and no key the TypedDict lacks."""
    keys = set(report)
    assert shape.__required_keys__ <= keys, (what, shape.__required_keys__ - keys)
    assert keys <= shape.__required_keys__ | shape.__optional_keys__, (
        what,
        keys - shape.__required_keys__ - shape.__optional_keys__,
    )


def test_the_reports_have_the_keys_their_typed_shapes_name(tmp_path):
    from imagefeed import reports

    imagefeed.synthesize(tmp_path / "src", classes=2, per_class=3, edge_cases=True)
    summary = imagefeed.pack(tmp_path / "src", tmp_path / "o.lmdb", progress=False)
    _keys_fit(summary, reports.PackSummary, "pack")
    assert summary["rejected"], "the edge cases hold files that are not images"
    _keys_fit(summary["rejected"][0], reports.Rejection, "rejection")
    parts = [tmp_path / f"p{i}.lmdb" for i in range(2)]
    for i, part in enumerate(parts):
        imagefeed.pack(tmp_path / "src", part, part=(i, 2), progress=False)
    joined = imagefeed.join(parts, tmp_path / "j.lmdb", progress=False)
    _keys_fit(joined, reports.PackSummary, "join")
    report = imagefeed.inspect(tmp_path / "o.lmdb")
    _keys_fit(report, reports.Inspection, "inspect")
    _keys_fit(report["classes"][0], reports.ClassCount, "class count")
    _keys_fit(report["width"], reports.Spread, "spread")
    _keys_fit(report["common_sizes"][0], reports.SizeCount, "size count")
    checked = imagefeed.verify(tmp_path / "o.lmdb", tmp_path / "src")
    _keys_fit(checked, reports.VerifyReport, "verify")
    # A problem: the source gained an image the dataset lacks.
    extra = tmp_path / "src" / "class00" / "extra.jpg"
    extra.write_bytes((next((tmp_path / "src" / "class00").glob("*.jpg"))).read_bytes())
    problems = imagefeed.verify(tmp_path / "o.lmdb", tmp_path / "src")["problems"]
    assert problems
    _keys_fit(problems[0], reports.Problem, "problem")
    loader = imagefeed.Loader(tmp_path / "o.lmdb", batch_size=4, rank=0, world_size=1, output="numpy")
    for _ in loader:
        pass
    _keys_fit(loader.stats(), reports.LoaderStats, "stats")
    _keys_fit(loader.state_dict(), reports.LoaderState, "state")
