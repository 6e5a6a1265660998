"""setup.py's packages cover every directory of .py files (issue 19: ``megatron_omni/trainer`` had no
``__init__.py``, so ``find_packages`` left it out of the wheel).  The built wheel itself is checked by
tests/packaging/check_wheel.py (``make check-wheel``, run by ``make test``)."""
import setuptools

from tests.packaging.check_wheel import REPO, expected_packages, package_roots


def test_find_packages_covers_every_directory_of_py_files():
    roots = package_roots()
    assert set(roots) == {"megatron_omni", "model_specs", "checkpoints_convert"}
    found = set(setuptools.find_packages(where=str(REPO), include=[p for r in roots for p in (r, f"{r}.*")]))
    wanted = expected_packages(REPO, roots)
    assert "megatron_omni.trainer" in wanted
    missing = sorted(d.replace(".", "/") for d in wanted - found)
    assert not missing, f"directories with .py files but no __init__.py (left out of the wheel): {missing}"
    assert found <= wanted, f"packages without .py files under them: {sorted(found - wanted)}"


def test_expected_packages_sees_a_directory_without_init(tmp_path):
    (tmp_path / "pkg" / "sub" / "deeper").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "deeper" / "mod.py").write_text("")  # neither sub/ nor deeper/ has __init__.py
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "stray.py").write_text("")
    assert expected_packages(tmp_path, ("pkg",)) == {"pkg", "pkg.sub", "pkg.sub.deeper"}
    assert setuptools.find_packages(where=str(tmp_path)) == ["pkg"]
