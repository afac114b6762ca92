"""The layering rules of docs/architecture.md, held to the code: read from each module's imports (its syntax tree), so
that a change that breaks a rule fails here, naming the module and the import."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trl_topr"


def imports(path: Path) -> list[tuple[str, list[str], int]]:
    """Each import of a file, anywhere in it: (the module imported, resolved for relative imports; the names taken;
    the line)."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            name = node.module or ""
            if node.level:
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, name] if name else base)
            found.append((name, [alias.name for alias in node.names], node.lineno))
    return found


def package_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize(
    "low",
    [
        "trl_topr/sampling.py",
        "trl_topr/evaluation.py",
        "trl_topr/logprobs.py",
        "trl_topr/trajectories.py",
        *[str(p.relative_to(ROOT)) for p in sorted((PACKAGE / "generation").glob("*.py"))],
    ],
)
def test_sampling_generation_and_logprobs_import_neither_config_nor_trainer(low):
    bad = upper_imports(ROOT / low)
    assert not bad, f"{low} imports {bad}: the lower layers read options duck-typed (docs/architecture.md)"


def upper_imports(path: Path) -> list[tuple[str, int]]:
    """The imports of a lower-layer module that reach the configuration, the trainers or the loop (or the package's
    top, which imports them all)."""
    upper = ("trl_topr.config", "trl_topr.trainer", "trl_topr.online", "trl_topr.loop")
    return [(name, line) for name, names, line in imports(path) if name in upper or (name == "trl_topr" and names)]


def test_no_module_imports_a_private_name_of_another():
    for path in [
        *package_files(),
        *sorted((ROOT / "benchmarks").glob("*.py")),
        *sorted((ROOT / "recipes").glob("*.py")),
    ]:
        for name, names, line in imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            assert not (private and (name.startswith("trl_topr") or "." not in name)), (
                f"{path.relative_to(ROOT)}:{line} imports {private} from {name}: make it public and documented"
            )


def test_benchmarks_import_no_tests_and_patch_no_path():
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        text = path.read_text()
        assert "sys.path.insert" not in text and "sys.path.append" not in text, f"{path.name} patches sys.path"
        tests = {p.stem for p in (ROOT / "tests").glob("*.py")}
        used = [(name, line) for name, _, line in imports(path) if name.split(".")[0] in tests]
        assert not used, f"{path.name} imports from tests/: {used}"


@pytest.mark.parametrize("added", ["from ..trainer import TOPRTrainer", "    from trl_topr.config import TOPRConfig"])
def test_a_rule_breaking_import_is_caught(tmp_path, monkeypatch, added):
    # the check reads real imports, relative or absolute, at any depth: one added to a lower module is found
    source = (PACKAGE / "generation" / "arguments.py").read_text()
    fake = tmp_path / "trl_topr" / "generation" / "arguments.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    fake.write_text(source)
    assert upper_imports(fake) == []
    fake.write_text(source + "\n\ndef later():\n" + (added if added.startswith(" ") else "    " + added) + "\n")
    assert [name for name, _ in upper_imports(fake)] == [added.split()[1].replace("..", "trl_topr.")]


def test_the_formatter_formats():
    # `ruff format` lays the code out (CI runs `ruff format --check`): few statements opt out, and no line is longer
    # than the configured 119 characters
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    files = [ROOT / name for name in listed if (ROOT / name).exists()]
    assert len(files) > 50
    skipped = {str(p.relative_to(ROOT)): p.read_text().count("# fmt: skip") for p in files}
    assert sum(skipped.values()) <= 20, {name: count for name, count in skipped.items() if count}
    long = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in files
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if len(line) > 119
    ]
    assert not long, long


# ------------------------------------------------------------------------------------------- the whole layer table
def layer_table(doc: str) -> dict[str, int]:
    """docs/architecture.md's layer table, bottom up: each module or folder it names (`loss.py`, `generation/`) and
    its layer's row, the first row lowest."""
    section = doc.split("## The layers, bottom up", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| layer")]
    layers = {}
    for index, row in enumerate(rows):
        for name in re.findall(r"`([\w/]+(?:\.py|/))`", row.split("|")[2]):
            layers[name] = index
    return layers


def layer_of(path: Path, layers: dict[str, int]) -> int | None:
    relative = path.relative_to(ROOT / "trl_topr")
    return layers.get(str(relative)) if len(relative.parts) == 1 else layers.get(f"{relative.parts[0]}/")


def climbing_imports(layers: dict[str, int], root: Path = PACKAGE) -> list[str]:
    """Every import of a package module that reaches a module of a higher layer than its own."""
    found = []
    for path in sorted(root.rglob("*.py")):
        own = layer_of(path, layers)
        for name, names, line in imports(path):
            if not name.startswith("trl_topr"):
                continue
            parts = name.split(".")[1:]
            # `from trl_topr import x` and `from .generation import y` name a package: their target is a module if
            # a name is one, else the package's `__init__.py`
            candidates = [ROOT / "trl_topr" / Path(*parts, n + ".py") for n in names] + [
                ROOT / "trl_topr" / Path(*parts).with_suffix(".py") if parts else ROOT / "trl_topr" / "__init__.py",
                ROOT / "trl_topr" / Path(*parts, "__init__.py"),
            ]
            for target in (c for c in candidates if c.exists()):
                theirs = layer_of(target, layers)
                if theirs is not None and own is not None and theirs > own:
                    found.append(f"{path.relative_to(ROOT)}:{line} imports {name} (layer {theirs} > {own})")
                break
    return found


def test_every_module_has_a_layer_and_no_import_climbs():
    layers = layer_table((ROOT / "docs" / "architecture.md").read_text())
    unplaced = [str(p.relative_to(ROOT)) for p in package_files() if layer_of(p, layers) is None]
    assert not unplaced, f"modules with no row in docs/architecture.md's layer table: {unplaced}"
    assert climbing_imports(layers) == []


def test_an_import_that_climbs_the_table_is_caught(tmp_path, monkeypatch):
    # a copy of the package whose data contract imports the trainer: caught, naming the line and the layers
    copy = tmp_path / "trl_topr"
    import shutil

    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    layers = layer_table((PACKAGE.parent / "docs" / "architecture.md").read_text())
    assert climbing_imports(layers, copy) == []
    (copy / "trajectories.py").write_text(
        (copy / "trajectories.py").read_text() + "\nfrom .trainer import TOPRTrainer\n"
    )
    (found,) = climbing_imports(layers, copy)
    assert found.startswith("trl_topr/trajectories.py:") and "imports trl_topr.trainer" in found


# ------------------------------------------------------------------------------------------------ the public surface
# What a user imports: `trl_topr.__all__`, `trl_topr.generation.__all__` for engine authors, and the embedded default's
# model and task (`trl_topr.embedded`, `trl_topr.tasks`), public and documented as the examples they are. The test
# fixtures (`trl_topr.testing`) are the tests' and benchmarks' own, not the library's API.
PUBLIC_PACKAGES = ("trl_topr", "trl_topr.generation", "trl_topr.embedded", "trl_topr.tasks")
OWN_MODULES = ("trl_topr.testing",)


def public_surface() -> dict[str, object]:
    """Every public name, `package.name`, and its object."""
    import importlib

    surface = {}
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        surface.update({f"{package}.{name}": getattr(module, name) for name in module.__all__})
    return surface


def documented(api: str) -> list[str]:
    """The names docs/api.md documents (`::: name`)."""
    return re.findall(r"^::: ([\w.]+)$", api, re.M)


def test_the_api_reference_documents_the_public_surface_and_nothing_else():
    import importlib

    surface = public_surface()
    names = documented((ROOT / "docs" / "api.md").read_text())
    objects = []
    for name in names:
        module, _, attribute = name.rpartition(".")
        objects.append(getattr(importlib.import_module(module), attribute))
    public = {id(value) for value in surface.values()}
    internal = [name for name, value in zip(names, objects) if id(value) not in public]
    assert not internal, f"docs/api.md documents names outside the public surface: {internal}"
    missing = [name for name, value in surface.items() if id(value) not in {id(o) for o in objects}]
    assert not missing, f"public names docs/api.md does not document: {missing}"
    assert len(names) == len(set(map(id, objects))), "a name is documented twice"


def non_public_imports(path: Path, allowed: tuple[str, ...] = OWN_MODULES) -> list[tuple[str, list[str], int]]:
    """A script's imports of trl_topr that are not public names (nor the allowed modules'), with their line."""
    public = set(public_surface())
    found = []
    for name, names, line in imports(path):
        if not name.startswith("trl_topr") or name in allowed or (not names and name in PUBLIC_PACKAGES):
            continue
        outside = [n for n in names if f"{name}.{n}" not in public] if names else [name]
        if outside:
            found.append((name, outside, line))
    return found


def test_recipes_import_only_the_public_api():
    missing = [
        f"{path.relative_to(ROOT)}:{line} imports {names} from {name}"
        for path in sorted((ROOT / "recipes").glob("*.py"))
        for name, names, line in non_public_imports(path)
    ]
    assert not missing, missing


def test_a_recipe_importing_an_internal_is_caught(tmp_path, monkeypatch):
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    path = tmp_path / "recipe.py"
    path.write_text(
        "import trl_topr\nfrom trl_topr import run_topr_loop\nfrom trl_topr.embedded import smollm2_path\n"
    )
    assert non_public_imports(path) == []
    path.write_text(path.read_text() + "from trl_topr.precision import device_type\nimport trl_topr.rollout\n")
    assert [(name, names) for name, names, _ in non_public_imports(path)] == [
        ("trl_topr.precision", ["device_type"]),
        ("trl_topr.rollout", ["trl_topr.rollout"]),
    ]


def test_benchmarks_reach_an_internal_only_where_a_comment_says_why():
    # benchmarks measure what users run, through the public names; an import of anything else says why on its line
    unexplained = []
    for path in sorted((ROOT / "benchmarks").glob("*.py")):
        lines = path.read_text().splitlines()
        for name, names, line in non_public_imports(path):
            if "#" not in lines[line - 1]:
                unexplained.append(f"{path.relative_to(ROOT)}:{line} imports {names} from {name}")
    assert not unexplained, unexplained


def test_the_package_patches_nothing_at_run_time():
    # no mock in the product: what it changes of TRL's behavior it subclasses, registers or injects
    for path in package_files():
        text = path.read_text()
        assert "unittest" not in text and "mock" not in text, path.relative_to(ROOT)


# ---------------------------------------------------------------------------------------------------- short functions
MOST_LINES = 59  # "under 60"


def code_lines(function: ast.FunctionDef, source: str) -> int:
    """A function's lines of code: its body's lines without its docstring, blank lines and comment lines."""
    body = function.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    text = source.splitlines()
    lines = {n for node in body for n in range(node.lineno, node.end_lineno + 1)}
    return sum(1 for n in lines if text[n - 1].strip() and not text[n - 1].strip().startswith("#"))


def long_functions(paths: list[Path]) -> list[str]:
    found = []
    for path in paths:
        source = path.read_text()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and code_lines(node, source) > MOST_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name} ({code_lines(node, source)} lines)")
    return found


def test_every_function_of_the_package_stays_short():
    assert long_functions(package_files()) == []


def test_a_long_function_is_caught(tmp_path):
    body = "\n".join(f"    x{n} = {n}  # step {n}" for n in range(MOST_LINES + 1))
    path = tmp_path / "long.py"
    path.write_text(f'def long():\n    """Doc."""\n\n    # a comment\n{body}\n\n\ndef short():\n    return 1\n')
    assert long_functions([path]) == [f"long.py:1 long ({MOST_LINES + 1} lines)"]


def test_importing_the_package_loads_no_script_and_no_fixture():
    # `import trl_topr` loads the library: not the command-line scripts, the embedded default model, nor the tests'
    # helpers (each of which a script or a recipe imports itself)
    code = "import sys, trl_topr; print(' '.join(sorted(m for m in sys.modules if m.startswith('trl_topr'))))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "trl_topr.loss" in loaded and "trl_topr.trainer" in loaded  # the check reads what was loaded
    unwanted = [m for m in loaded if m.startswith(("trl_topr.scripts", "trl_topr.embedded", "trl_topr.testing"))]
    assert not unwanted, unwanted


def private_names(path: Path) -> tuple[dict[str, int], set[str]]:
    """The private names (`_name`) a file uses as attributes or imports from TRL, each with its first line, and the
    attributes it defines itself (methods and class attributes of its classes, attributes it assigns)."""
    used, defined = {}, set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            used.setdefault(node.attr, node.lineno)
            if isinstance(node.ctx, ast.Store):
                defined.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    defined.add(item.name)
                elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                    targets = item.targets if isinstance(item, ast.Assign) else [item.target]
                    defined.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "trl":
            used.update({alias.name: node.lineno for alias in node.names if alias.name.startswith("_")})
    return used, defined


def test_trls_private_names_appear_in_the_seam_only():
    # A private name of TRL's (a method, attribute or function it defines) used anywhere in the package but
    # trl_seam/, where each has its reason and its test (tests/test_trl_seam.py); names the package defines itself
    # (its own `_forward`, `_topr_metrics`) are its own
    import trl

    trl_source = "\n".join(p.read_text(errors="replace") for p in Path(trl.__file__).parent.rglob("*.py"))
    ours, uses = set(), []
    for path in package_files():
        used, defined = private_names(path)
        ours |= defined
        if "trl_seam" not in path.parts:
            uses += [(name, path, line) for name, line in used.items()]
    trls = [
        f"{path.relative_to(ROOT)}:{line} uses TRL's `{name}`"
        for name, path, line in uses
        if name not in ours and re.search(rf"(def |class |self\.|import ){re.escape(name)}\b", trl_source)
    ]
    assert not trls, "TRL's private names outside trl_topr/trl_seam/: " + "; ".join(trls)
