"""The wheel as a user installs it (issue 19): build it, install it, not editable, into a fresh venv, run it
from outside the checkout.

    .venv/bin/python tests/packaging/check_wheel.py [--keep] [--ref COMMIT]   (`make check-wheel`, in `make test`)

1. copy the checkout's files (git's view: tracked and untracked-but-not-ignored, so no .venv, build/ or
   *.egg-info; with --ref, a commit's files) to a temp dir and ``pip wheel --no-deps --no-build-isolation
   --no-index`` there: no network, nothing written into the checkout;
2. check the wheel holds every package (each directory with .py files under setup.PACKAGE_ROOTS), every
   .py file and every other file found under those roots (data files the code may read at run time);
3. create a fresh venv (same interpreter) outside the checkout.  It sees the project venv's pinned
   dependencies through one ``.pth`` line naming a folder of symlinks to the project venv's site-packages
   entries, less megatron-omni's own (its dist-info and the ``__editable__`` finder): a folder named in a
   .pth line does not get its own .pth files run, and the finder is not even there, so only the wheel can
   provide the packages.  ``pip install --no-deps`` the wheel into it, then ``pip check``;
4. from a temp working directory, with PYTHONPATH unset: ``megatron-omni --help``,
   ``megatron-omni train --recipe digits_flow_grpo --print-config``, ``megatron-omni convert --help`` and
   ``megatron-omni bench --help``
   must exit 0, and every module of the installed packages (``pkgutil.walk_packages``) must import from the
   fresh venv's site-packages, with no sys.path entry inside the checkout.

Exits 1 with the reasons on the first failing step; removes its temp dirs unless --keep.
"""
from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib.metadata
import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
COMMANDS = (["--help"], ["train", "--recipe", "digits_flow_grpo", "--print-config"], ["convert", "--help"],
            ["bench", "--help"])
# never copied when git cannot list the files (no git, or not a checkout)
COPY_IGNORE = (".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", "runs", "wandb")


class CheckFailed(Exception):
    pass


def package_roots(repo: Path = REPO) -> tuple[str, ...]:
    """setup.py's PACKAGE_ROOTS, read without running setup.py."""
    for node in ast.parse((repo / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "PACKAGE_ROOTS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise CheckFailed(f"{repo / 'setup.py'} has no PACKAGE_ROOTS = (...) assignment")


def _skipped(parts: tuple[str, ...]) -> bool:
    return any(part == "__pycache__" or part.startswith(".") for part in parts)


def expected_packages(tree: Path, roots: tuple[str, ...]) -> set[str]:
    """Dotted names of the directories under ``roots`` (relative to ``tree``) that hold .py files, and of
    every directory between them and their root: each must be a package for setuptools to reach it."""
    packages = set()
    for root in roots:
        for source in (tree / root).rglob("*.py"):
            parts = source.parent.relative_to(tree).parts
            if not _skipped(parts):
                packages.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
    return packages


def package_files(tree: Path, roots: tuple[str, ...]) -> set[str]:
    """Every file under ``roots`` as a POSIX path relative to ``tree``, bytecode caches left out."""
    return {p.relative_to(tree).as_posix() for root in roots for p in (tree / root).rglob("*")
            if p.is_file() and not _skipped(p.relative_to(tree).parts) and p.suffix not in (".pyc", ".pyo")}


RUNNING: list[subprocess.Popen] = []  # killed if a check fails while they run


def _start(cmd: list, text: bool = True, **kw) -> subprocess.Popen:
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=text, **kw)
    RUNNING.append(proc)
    return proc


def _finish(proc: subprocess.Popen, what: str) -> subprocess.CompletedProcess:
    """Wait for ``proc``; raise with the tail of its output unless it exited 0."""
    out, err = proc.communicate()
    RUNNING.remove(proc)
    if proc.returncode != 0:
        text = (out + err) if isinstance(out, str) else (out + err).decode(errors="replace")
        tail = "\n".join(text.strip().splitlines()[-40:])
        raise CheckFailed(f"{what} exited {proc.returncode}: {' '.join(proc.args)}\n{tail}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _run(cmd: list, what: str, **kw) -> subprocess.CompletedProcess:
    return _finish(_start(cmd, **kw), what)


def copy_source(dest: Path, ref: str | None = None) -> int:
    """Copy the files of the checkout, as git sees them, to ``dest`` (those of commit ``ref`` if given);
    returns the count."""
    if ref is not None:
        archive = _run(["git", "archive", "--format=tar", ref], f"git archive {ref}", cwd=REPO, text=False)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        return sum(1 for p in dest.rglob("*") if p.is_file())
    try:
        listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                                cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(*COPY_IGNORE), symlinks=True)
        return sum(1 for p in dest.rglob("*") if p.is_file())
    count = 0
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():  # a tracked file deleted in the working tree is left out, as a build would
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
            count += 1
    return count


def check_wheel_contents(wheel: Path, src: Path, roots: tuple[str, ...]) -> int:
    """The wheel holds every package and every file found under the roots in the source; returns the
    number of packages."""
    names = {n for n in zipfile.ZipFile(wheel).namelist() if n.split("/", 1)[0] in roots}
    in_wheel = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith(".py")}
    wanted = expected_packages(src, roots)
    problems = []
    if in_wheel != wanted:
        problems.append(f"packages missing from the wheel: {sorted(wanted - in_wheel)}; "
                        f"in the wheel but not in the source: {sorted(in_wheel - wanted)}")
    missing_files = sorted(package_files(src, roots) - names)
    if missing_files:
        problems.append(f"files under the packages but not in the wheel (a missing __init__.py, or data files "
                        f"to declare in setup.py package_data): {missing_files}")
    if problems:
        raise CheckFailed(f"{wheel.name}:\n  " + "\n  ".join(problems))
    return len(in_wheel)


def own_entries(site: Path) -> set[str]:
    """The top-level site-packages entries that belong to megatron-omni itself in the project venv (its
    dist-info, the editable install's .pth and finder; the packages, were it installed from a wheel)."""
    patterns = {"__editable__*megatron_omni*", "megatron_omni-*", "megatron-omni*"}
    entries = {e.name for e in site.iterdir() if any(fnmatch.fnmatch(e.name, p) for p in patterns)}
    for dist in importlib.metadata.distributions(path=[str(site)]):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") == "megatron-omni":
            entries.update(Path(f).parts[0] for f in dist.files or () if not Path(f).parts[0].startswith(".."))
    return entries


def link_dependencies(site: Path, deps: Path, roots: tuple[str, ...]) -> tuple[int, list[str]]:
    """Fill ``deps`` with a symlink to each entry of ``site`` but megatron-omni's own, the .pth files (not
    run from a .pth-named folder anyway) and the bytecode cache; returns (links, entries left out)."""
    skip = own_entries(site) | set(roots) | {"__pycache__"}
    left_out = sorted(e.name for e in site.iterdir() if e.name in skip or e.suffix == ".pth")
    deps.mkdir()
    links = 0
    for entry in sorted(site.iterdir()):
        if entry.name not in left_out:
            (deps / entry.name).symlink_to(entry)
            links += 1
    return links, left_out


# Run by the fresh venv's python (-I: no PYTHONPATH, no user site, no cwd on sys.path; -B: no bytecode written
# through the links into the project venv); prints one JSON line.
IMPORT_ALL = r"""
import importlib, importlib.metadata, json, pkgutil, sys, sysconfig
from pathlib import Path

repo, roots = Path(sys.argv[1]), sys.argv[2:]
site = Path(sysconfig.get_path("purelib")).resolve()
report = {"site": str(site), "modules": 0, "failed": {}, "outside": {}}
report["repo_on_path"] = [p for p in sys.path if p and Path(p).resolve().is_relative_to(repo)]
report["editable_finders"] = sorted(m for m in sys.modules if m.startswith("__editable__"))
dist = importlib.metadata.distribution("megatron-omni")
report["dist"] = str(Path(dist.locate_file("")).resolve())
import megatron_omni
report["megatron_omni_file"] = megatron_omni.__file__

names = []
for root in roots:
    try:
        package = importlib.import_module(root)
    except BaseException as e:
        report["failed"][root] = f"{type(e).__name__}: {e}"
        continue
    names.append(root)
    names += [m.name for m in pkgutil.walk_packages(package.__path__, root + ".",
                                                    onerror=lambda name: names.append(name))]
for name in dict.fromkeys(names):
    try:
        module = importlib.import_module(name)
    except BaseException as e:  # SystemExit included: a module must not exit on import
        report["failed"][name] = f"{type(e).__name__}: {e}".splitlines()[0]
        continue
    report["modules"] += 1
    where = getattr(module, "__file__", None)
    if where is None or not Path(where).resolve().is_relative_to(site):
        report["outside"][name] = where or f"no __file__ (namespace package, no __init__.py): {list(module.__path__)}"
print(json.dumps(report))
"""


def report_problems(report: dict, fresh_site: Path) -> list[str]:
    """What is wrong in the import walk's report: modules that fail to import or come from elsewhere than the
    fresh venv, the checkout on sys.path, the editable finder active, megatron-omni's metadata elsewhere."""
    problems = []
    if report["failed"]:
        problems.append("modules that fail to import:\n" +
                        "\n".join(f"    {n}: {e}" for n, e in sorted(report["failed"].items())))
    if report["outside"]:
        problems.append(f"modules not imported from the fresh venv's site-packages {report['site']}:\n" +
                        "\n".join(f"    {n}: {f}" for n, f in sorted(report["outside"].items())))
    if report["repo_on_path"]:
        problems.append(f"sys.path entries inside the checkout: {report['repo_on_path']}")
    if report["editable_finders"]:
        problems.append(f"the editable install's finder is active: {report['editable_finders']}")
    site = fresh_site.resolve()
    if not Path(report["dist"]).is_relative_to(site):
        problems.append(f"importlib.metadata finds megatron-omni at {report['dist']}, not in {site}")
    if not Path(report["megatron_omni_file"]).resolve().is_relative_to(site):
        problems.append(f"megatron_omni.__file__ is {report['megatron_omni_file']}, not in {site}")
    return problems


def check(keep: bool = False, ref: str | None = None) -> None:
    t0 = time.monotonic()
    if sys.prefix == sys.base_prefix:
        raise CheckFailed(f"run this with the project venv's python (make check-wheel), not {sys.executable}")
    roots = package_roots()
    tmp = Path(tempfile.mkdtemp(prefix="megatron-omni-wheel-")).resolve()
    try:
        if tmp.is_relative_to(REPO):
            raise CheckFailed(f"the temp dir {tmp} is inside the checkout {REPO}: set TMPDIR elsewhere")
        src, dist, venv, deps, work = (tmp / n for n in ("src", "dist", "venv", "deps", "work"))
        work.mkdir()

        # 1. build from a copy
        copied = copy_source(src, ref)
        _run([sys.executable, "-m", "pip", "wheel", src, "--no-deps", "--no-build-isolation", "--no-index",
              "--disable-pip-version-check", "-q", "-w", dist], "pip wheel", cwd=src)
        wheels = sorted(dist.glob("*.whl"))
        if len(wheels) != 1:
            raise CheckFailed(f"pip wheel left {[w.name for w in wheels]} in {dist}; expected one wheel")
        wheel = wheels[0]
        t_build = time.monotonic() - t0

        # 2. what the wheel holds
        packages = check_wheel_contents(wheel, src, roots)

        # 3. fresh venv beside the pinned dependencies, the wheel installed into it
        _run([sys.executable, "-m", "venv", "--without-pip", venv], "python -m venv")
        python = venv / "bin" / "python"
        fresh_site = Path(_run([python, "-I", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               "fresh python").stdout.strip())
        project_site = Path(sysconfig.get_path("purelib"))
        links, left_out = link_dependencies(project_site, deps, roots)
        (fresh_site / "_megatron_omni_check_deps.pth").write_text(f"{deps}\n")
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONSAFEPATH", "VIRTUAL_ENV")
               and not k.startswith("PIP_")}
        env.update(VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                   PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1",  # no caches written into the project venv
                   PIP_ROOT_USER_ACTION="ignore", PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INDEX="1")
        pip = [python, "-I", "-m", "pip"]  # pip itself comes from the linked dependencies
        _run(pip + ["install", "--no-deps", "--no-warn-script-location", "-q", wheel], "pip install",
             cwd=work, env=env)
        pip_check = _run(pip + ["check"], "pip check", cwd=work, env=env).stdout.strip()

        # 4. run it from outside the checkout: the three commands and the import walk side by side
        t_run = time.monotonic()
        exe = venv / "bin" / "megatron-omni"
        started = [(f"megatron-omni {' '.join(args)}", _start([exe, *args], cwd=work, env=env)) for args in COMMANDS]
        walk = _start([python, "-I", "-B", "-c", IMPORT_ALL, REPO, *roots], cwd=work, env=env)
        codes = []
        for what, proc in started:
            done = _finish(proc, what)
            if not done.stdout.strip():
                raise CheckFailed(f"{what} printed nothing")
            codes.append((what, done.returncode, len(done.stdout.splitlines())))
        report = json.loads(_finish(walk, "the import walk").stdout.strip().splitlines()[-1])
        t_run = time.monotonic() - t_run
        problems = report_problems(report, fresh_site)
        if problems:
            raise CheckFailed("\n  ".join(problems))

        print(f"wheel        {wheel.name}, {wheel.stat().st_size / 1024:.1f} KiB, {packages} packages "
              f"(built from {copied} files of {ref or 'the working tree'}, {t_build:.1f} s)")
        print(f"fresh venv   {venv} (python {sys.version.split()[0]}); dependencies: {links} links to "
              f"{project_site}, left out: {', '.join(left_out)}")
        print(f"installed    megatron_omni.__file__ = {report['megatron_omni_file']}")
        print(f"pip check    {pip_check}")
        for what, code, lines in codes:
            print(f"exit {code}       {what}  ({lines} lines of output; cwd {work})")
        print(f"imports      {report['modules']} modules of {', '.join(roots)}, all from the fresh venv "
              f"(commands and imports together {t_run:.1f} s)")
        times = os.times()
        print(f"check-wheel: OK in {time.monotonic() - t0:.1f} s wall, "
              f"{times.children_user + times.children_system:.1f} s CPU in its subprocesses")
    finally:
        for proc in RUNNING:
            proc.kill()
            proc.wait()
        RUNNING.clear()
        if keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs (wheel, venv) and print where")
    parser.add_argument("--ref", metavar="COMMIT", help="build the files of this commit (git archive), "
                        "not the working tree's")
    args = parser.parse_args(argv)
    try:
        check(args.keep, args.ref)
    except CheckFailed as e:
        print(f"check-wheel: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
