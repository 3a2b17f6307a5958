"""Installing the repo (regular and editable) makes the package_dir-mapped subpackages importable.

``kernels/`` and ``callbacks/`` live at the top of the repo and are mapped onto
``lightning_gproj.kernels`` / ``lightning_gproj.callbacks`` by setup.cfg's ``package_dir``; a mistake
there shows only in an install, never in the source tree. Each case installs into a fresh venv made
``--without-pip``, with ``--no-deps``; a .pth line appends this interpreter's site-packages so torch and
friends resolve without another download. A path line in a .pth does not run the .pth files of the
folder it names, so this environment's own editable install of lightning_gproj stays inactive; the test
checks that too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEV_SITE = [Path(p).resolve() for p in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}]

PROBE = textwrap.dedent("""
    import json, sys
    import lightning_gproj, lightning_gproj.kernels, lightning_gproj.callbacks
    # setuptools' editable hook puts a class (not an instance) on sys.meta_path
    modules = [f.__module__ if isinstance(f, type) else type(f).__module__ for f in sys.meta_path]
    finders = [getattr(sys.modules.get(m), "__file__", None) for m in modules]
    print(json.dumps({
        "package": lightning_gproj.__file__,
        "kernels": lightning_gproj.kernels.__file__,
        "callbacks": lightning_gproj.callbacks.__file__,
        "version": lightning_gproj.__version__,
        "finders": [f for f in finders if f],
        "path": sys.path,
    }))
""")


def _can_build_offline() -> bool:
    """Whether this interpreter can build a wheel without build isolation (no index needed)."""
    try:
        import setuptools
    except ImportError:
        return False
    major_minor = tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2])
    if major_minor >= (70, 1):  # setuptools ships bdist_wheel itself from 70.1
        return True
    try:
        import wheel  # noqa: F401
    except ImportError:
        return False
    return True


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, **kw)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


def _venv(tmp: Path) -> tuple[Path, Path]:
    """A pip-less venv whose site-packages also sees this interpreter's site-packages -> (python, site)."""
    _run([sys.executable, "-m", "venv", "--without-pip", str(tmp / "venv")])
    python = tmp / "venv" / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
                .stdout.strip())
    (site / "_dev_site_packages.pth").write_text("".join(f"{p}\n" for p in DEV_SITE))
    return python, site


def _pip_install(python: Path, *args: str) -> None:
    extra = ["--no-build-isolation"] if _can_build_offline() else []
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-cache-dir",
          *extra, *args])


def _probe(python: Path, cwd: Path) -> dict:
    return json.loads(_run([str(python), "-c", PROBE], cwd=cwd).stdout.strip().splitlines()[-1])


def _setup_cfg_version() -> str:
    """The version setup.cfg declares (what lightning_gproj.__version__ must report once installed)."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    return cfg["metadata"]["version"]


def _is_under(path: str | Path, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def _assert_dev_install_inactive(info: dict) -> None:
    # (other finders of this environment, e.g. one that transformers installs on import, are fine)
    for finder in info["finders"]:
        assert not ("editable" in Path(finder).name and any(_is_under(finder, site) for site in DEV_SITE)), \
            f"this environment's own editable finder {finder} is active in the test venv"


@pytest.mark.skipif(sys.platform == "win32", reason="venv layout is POSIX here")
def test_regular_install_imports_mapped_subpackages(tmp_path):
    # Build from a copy so that setuptools' build/ and egg-info never land in the repo.
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "*.egg-info", "logs", "lightning_logs", "__pycache__"))
    python, site = _venv(tmp_path)
    _pip_install(python, str(src))
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    info = _probe(python, run_dir)

    pkg = site / "lightning_gproj"
    assert Path(info["package"]).resolve() == (pkg / "__init__.py").resolve()
    assert Path(info["kernels"]).resolve() == (pkg / "kernels" / "__init__.py").resolve()
    assert Path(info["callbacks"]).resolve() == (pkg / "callbacks" / "__init__.py").resolve()
    assert info["version"] == _setup_cfg_version()
    _assert_dev_install_inactive(info)
    # (this environment may itself live inside the repo, as .venv/ does: only the source dirs count)
    sources = {REPO, REPO / "kernels", REPO / "callbacks", REPO / "lightning_gproj"}
    assert not sources & {Path(p).resolve() for p in info["path"] if p}, "the source tree is on sys.path"
    # Run from the clone's root, its lightning_gproj/ folder shadows the installed package (the working directory
    # comes first on sys.path): the mapped subpackages then come from the same tree, not an ImportError.
    info = _probe(python, src)
    assert Path(info["package"]).resolve() == (src / "lightning_gproj" / "__init__.py").resolve()
    assert Path(info["kernels"]).resolve() == (src / "kernels" / "__init__.py").resolve()
    assert Path(info["callbacks"]).resolve() == (src / "callbacks" / "__init__.py").resolve()


@pytest.mark.skipif(sys.platform == "win32", reason="venv layout is POSIX here")
def test_editable_install_imports_mapped_subpackages(tmp_path):
    python, site = _venv(tmp_path)
    _pip_install(python, "-e", str(REPO))
    run_dir = tmp_path / "elsewhere"
    run_dir.mkdir()
    info = _probe(python, run_dir)

    assert Path(info["package"]).resolve() == REPO / "lightning_gproj" / "__init__.py"
    assert Path(info["kernels"]).resolve() == REPO / "kernels" / "__init__.py"
    assert Path(info["callbacks"]).resolve() == REPO / "callbacks" / "__init__.py"
    assert info["version"] == _setup_cfg_version()
    _assert_dev_install_inactive(info)
    # The editable hook that resolved them is the test venv's own.
    assert any(_is_under(f, site) and "editable" in Path(f).name for f in info["finders"]), info["finders"]


def test_ci_runs_the_readme_test_command():
    """.ci/run executes the README's test command, which must be a single line ending in pytest."""
    ci = (REPO / ".ci" / "run").read_text()
    assert "readme_command test" in ci
    out = subprocess.run(["bash", str(REPO / ".ci" / "run"), "--print"], capture_output=True, text=True,
                         cwd=REPO, timeout=30)
    assert out.returncode == 0, out.stderr
    test_cmd = out.stdout.strip()
    assert "\n" not in test_cmd
    assert test_cmd.startswith("python3 -m venv .venv && ")
    assert test_cmd.endswith(".venv/bin/python -m pytest -q")
    assert f"\n{test_cmd}\n" in (REPO / "README.md").read_text()


@pytest.mark.parametrize(
    "command, ok",
    [
        ('echo "3 passed in 0.1s"', True),
        ('echo "1 failed, 3 passed in 0.1s"; exit 1', False),  # a failing suite fails CI, whatever it printed
        ('false && echo "3 passed in 0.1s"', False),  # a failing set-up step before the tests
        ('echo "5 skipped in 0.1s"', False),  # exit 0 with no test run
        ('echo "3 passed in 0.1s" && python3 -c "import sys; sys.exit(2)"', False),
    ],
)
def test_ci_run_exit_status_follows_the_readme_command(tmp_path, command, ok):
    """.ci/run on a README whose test command is ``command``: it fails exactly when the command fails
    (the pipe through tee keeps the status) or ran no test, so CI cannot pass while the README's
    command fails."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(REPO / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "README.md").write_text(f"# x\n\n<!-- readme_command test -->\n```bash\n{command}\n```\n")
    out = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, cwd=tmp_path,
                         timeout=60, stdin=subprocess.DEVNULL, env={**os.environ, "CI": "true"})
    assert (out.returncode == 0) is ok, (out.returncode, out.stdout, out.stderr)
