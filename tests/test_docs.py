"""What a newcomer reads must hold: every markdown file the repository cites exists in it, every numbered
decision cited exists in docs/design.md, and every recipe's ``train --print-config`` runs and reads back.

A citation is any word ending in ``.md`` in a .py / .md / .sh / .sbatch file or a Makefile that git tracks
(or would track: untracked files not ignored count too, so a new file is checked before its commit).  It
resolves when it names a file of the repository relative to the repository root or to the citing file's
folder; an absolute path must lie inside the repository.  A bare upper-case name with no file behind it
(a document kept outside the repository) is a failure, as is any other dangling name.
"""
from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from megatron_omni import cli
from megatron_omni.config import load_config, recipe_names

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".md", ".sh", ".sbatch")
URL = re.compile(r"\w+://\S+")
# a relative or absolute path, or a bare name, ending in .md; not the tail of a longer word or path
MD_REF = re.compile(r"(?<![\w./~-])(/?(?:[\w.-]+/)*[\w-][\w.-]*\.md)(?![\w-])")
DECISION_REF = re.compile(r"\b[Dd]ecision (\d+)\b")
DESIGN = "docs/design.md"
MD = ".md"  # names below are built from it, so that this file cites nothing itself



def _repo_files() -> list[str]:
    """Paths (relative, posix) of the files git tracks or would track, that exist in the working tree."""
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                             capture_output=True, check=True).stdout.decode()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (an unpacked sdist): every file but builds
        skip = {".git", ".venv", "build", "dist", "runs", "wandb", "__pycache__"}
        return sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                      if p.is_file() and not skip & set(p.relative_to(ROOT).parts))
    return sorted({p for p in out.split("\0") if p and (ROOT / p).is_file()})


def _scanned(files: list[str]) -> list[str]:
    return [p for p in files if p.endswith(SUFFIXES) or posixpath.basename(p) == "Makefile"]


def _lines(path: str):
    text = (ROOT / path).read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), start=1):
        yield number, URL.sub(" ", line)


def _resolves(ref: str, citing: str, files: set[str]) -> bool:
    if ref.startswith("/"):
        try:
            ref = Path(ref).resolve().relative_to(ROOT).as_posix()
        except ValueError:  # outside the repository
            return False
        return ref in files
    bases = ("", posixpath.dirname(citing))
    return any(posixpath.normpath(posixpath.join(base, ref)) in files for base in bases)


def _citations(files: list[str]) -> list[tuple[str, int, str]]:
    """(citing file, line, cited name) of every markdown citation in the scanned files."""
    return [(path, number, m.group(1)) for path in _scanned(files) for number, line in _lines(path)
            for m in MD_REF.finditer(line)]


def test_every_cited_markdown_file_exists():
    files = _repo_files()
    present = set(files)
    dangling = [f"{path}:{number}: {ref}" for path, number, ref in _citations(files)
                if not _resolves(ref, path, present)]
    assert not dangling, ("markdown files cited but not in the repository (point the citation at docs/, or add "
                          "the file):\n  " + "\n  ".join(dangling))


def _design_decisions() -> set[int]:
    text = (ROOT / DESIGN).read_text(encoding="utf-8")
    section = text.split("## Decisions", 1)
    assert len(section) == 2, f"{DESIGN} has no '## Decisions' section"
    body = section[1].split("\n## ", 1)[0]
    return {int(n) for n in re.findall(r"^(\d+)\. ", body, flags=re.M)}


def test_every_cited_decision_is_in_the_design():
    decisions = _design_decisions()
    assert decisions == set(range(1, len(decisions) + 1)), f"{DESIGN}'s decisions are not numbered 1..N: {decisions}"
    missing = [f"{path}:{number}: decision {m.group(1)}" for path in _scanned(_repo_files())
               for number, line in _lines(path) for m in DECISION_REF.finditer(line)
               if int(m.group(1)) not in decisions]
    assert not missing, f"decisions cited but not numbered in {DESIGN}:\n  " + "\n  ".join(missing)


def test_citation_pattern():
    """The pattern finds what readers see as citations, and nothing inside URLs or longer words."""
    def refs(line: str) -> list[str]:
        return MD_REF.findall(URL.sub(" ", line))

    md = MD
    assert refs(f"see docs/algorithms{md}, decision 6") == [f"docs/algorithms{md}"]
    assert refs(f"(BENCH{md}'s table) and `launch/README{md}`") == [f"BENCH{md}", f"launch/README{md}"]
    assert refs(f"[index](../README{md}) /abs/path/X{md}") == [f"../README{md}", f"/abs/path/X{md}"]
    assert refs(f"https://example.org/a/README{md} x{md}x *{md} notes.mdx") == []
    readme, design = f"README{md}", f"design{md}"
    present = {readme, f"docs/{design}", f"launch/{readme}"}
    assert _resolves(design, f"docs/{readme}", present)
    assert _resolves(readme, "launch/slurm.sbatch", present)
    assert _resolves(f"../{readme}", f"docs/{readme}", present)
    assert not _resolves(design, readme, present)
    assert not _resolves(design.upper().replace(".MD", md), "megatron_omni/x.py", present)
    assert not _resolves(f"/elsewhere/{readme}", readme, present)


@pytest.mark.parametrize("recipe", recipe_names())
def test_every_recipe_prints_a_config_that_reads_back(recipe, capsys, tmp_path):
    assert cli.main(["train", "--recipe", recipe, "--print-config"]) == 0
    printed = capsys.readouterr().out
    assert isinstance(yaml.safe_load(printed), dict)
    (tmp_path / "run.yaml").write_text(printed)
    assert load_config(None, str(tmp_path / "run.yaml")) == load_config(recipe)


def test_launch_example_config_validates(capsys):
    """launch/README's two-node example merges onto its recipe."""
    argv = ["train", "--recipe", "qwen_image_full", "--config", str(ROOT / "launch/qwen_image_full_2node.yaml"),
            "--print-config"]
    assert cli.main(argv) == 0
    assert yaml.safe_load(capsys.readouterr().out)["parallel"]["cp"] == 4
