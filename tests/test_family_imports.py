"""Generic code imports no model family by name (docs/design.md: families are plug-ins).

Walks every import statement (module level and inside functions) of the generic packages — rollout, sync,
trainer, algorithms, config and the convert CLI — and fails on one that names a family's folder
(``model_specs.<family>``) or mapping table (``checkpoints_convert.<family>``).  Recipes are data that choose a
family, so ``config/recipes.py`` may.  Generic code asks ``model_specs.family`` instead.
"""
import ast
from pathlib import Path

from model_specs.family import family_names

ROOT = Path(__file__).resolve().parents[1]
GENERIC = [*(ROOT / "megatron_omni" / d for d in ("rollout", "sync", "trainer", "algorithms", "config")),
           *(ROOT / "checkpoints_convert" / f for f in ("cli.py", "convert.py", "mapping.py", "hf_folder.py",
                                                          "mcore_checkpoint.py"))]
EXEMPT = {ROOT / "megatron_omni" / "config" / "recipes.py"}


def _files():
    for path in GENERIC:
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def _imported(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def family_imports() -> dict[str, list[str]]:
    """generic file -> the family modules it imports."""
    families = set(family_names()) | {p.name for p in (ROOT / "model_specs").iterdir()
                                      if p.is_dir() and p.name not in ("common", "__pycache__")}
    bad = {f"{pkg}.{name}" for pkg in ("model_specs", "checkpoints_convert") for name in families}
    out = {}
    for path in _files():
        if path in EXEMPT:
            continue
        names = {m for m in _imported(ast.parse(path.read_text())) if any(m == b or m.startswith(b + ".") for b in bad)}
        out[str(path.relative_to(ROOT))] = sorted(names)
    return out


def test_generic_code_imports_no_family():
    view = family_imports()
    assert len(view) > 30  # the walk found the generic packages
    offenders = {path: names for path, names in view.items() if names}
    assert not offenders, f"generic code imports model families by name: {offenders}"


def test_the_walk_catches_a_family_import(tmp_path):
    tree = ast.parse("def f():\n    from model_specs.qwen_image.model import QwenImageModel\n")
    assert "model_specs.qwen_image.model" in set(_imported(tree))


if __name__ == "__main__":  # the view: which generic file imports which family
    for path, names in family_imports().items():
        print(f"{path}: {', '.join(names) or '-'}")
