"""Binder installs what the README installs: no drift between binder/, pyproject.toml and README.md.

Binder (repo2docker) installs ``binder/requirements.txt`` and then runs ``binder/postBuild``. Together
they must install exactly the README's ``pip install -e ".[lab]"``: nbaccel's dependencies plus the
extras the README names, with the same version ranges, torch from the CPU wheel index (Binder has no
GPU), and nbaccel itself from the checkout. And the README's Binder badge must open the quickstart.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
BINDER = ROOT / "binder"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
BADGE_URL = "https://mybinder.org/v2/gh/nbaccel/nbaccel/HEAD?labpath=notebooks%2F01_quickstart.ipynb"
BADGE = f"[![Binder](https://mybinder.org/badge_logo.svg)]({BADGE_URL})"


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _readme_try_command() -> str:
    """The README's first install command (the 'Try it' one, before the test command)."""
    for line in _readme().splitlines():
        if line.startswith("pip install"):
            return line
    raise AssertionError("README.md has no `pip install ...` line")


def _readme_extras() -> set[str]:
    match = re.search(r'pip install -e "\.\[([^\]]*)\]"', _readme_try_command())
    assert match, f"the README's install command does not install the checkout with extras: {_readme_try_command()}"
    return {e.strip() for e in match.group(1).split(",") if e.strip()}


def _expected() -> dict[str, Requirement]:
    """What `pip install -e ".[<README extras>]"` asks for: dependencies + those extras."""
    project = _pyproject()["project"]
    specs = list(project["dependencies"])
    for extra in sorted(_readme_extras()):
        specs += project["optional-dependencies"][extra]
    reqs = {}
    for spec in specs:
        req = Requirement(spec)
        reqs[canonicalize_name(req.name)] = req
    return reqs


def _requirements_file() -> dict[str, Requirement]:
    reqs = {}
    for raw in (BINDER / "requirements.txt").read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        assert not line.startswith("-"), f"binder/requirements.txt: option lines belong in postBuild: {line!r}"
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name not in reqs, f"binder/requirements.txt lists {req.name} twice"
        reqs[name] = req
    return reqs


def _postbuild_pip_installs() -> list[list[str]]:
    """The arguments of every `pip install` in postBuild (continuation lines joined, comments dropped)."""
    text = (BINDER / "postBuild").read_text().replace("\\\n", " ")
    installs = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        words = shlex.split(line)
        for i in range(len(words) - 1):
            if words[i] == "pip" and words[i + 1] == "install":
                installs.append(words[i + 2:])
                break
    return installs


def _split_install(args: list[str]) -> tuple[list[str], dict[str, str]]:
    """(package arguments, options with a value) of one `pip install` command line."""
    packages, options = [], {}
    it = iter(args)
    for word in it:
        if word in {"--index-url", "-i", "--extra-index-url", "-f", "--find-links", "-c", "--constraint"}:
            options[word] = next(it)
        elif word.startswith("-") and word not in {"-e", "--editable"}:
            continue
        elif word in {"-e", "--editable"}:
            packages.append("-e " + next(it))
        else:
            packages.append(word)
    return packages, options


def test_binder_files_exist_and_postbuild_is_a_valid_executable_script():
    assert (BINDER / "requirements.txt").is_file()
    post = BINDER / "postBuild"
    assert post.is_file() and os.access(post, os.X_OK), "binder/postBuild must exist and be executable"
    assert post.read_text().startswith("#!"), "postBuild needs a shebang line"
    result = subprocess.run(["bash", "-n", str(post)], capture_output=True, text=True)
    assert result.returncode == 0, f"postBuild is not valid bash: {result.stderr}"
    assert "set -e" in post.read_text(), "postBuild must stop at the first failing command (set -e)"


def test_binder_installs_the_same_packages_as_the_readme():
    expected = _expected()
    installed: dict[str, Requirement] = dict(_requirements_file())
    repo_installs = []
    for args in _postbuild_pip_installs():
        packages, _ = _split_install(args)
        for p in packages:
            if p.startswith("-e ") or p.startswith("."):
                repo_installs.append(p)
                continue
            req = Requirement(p)
            name = canonicalize_name(req.name)
            assert name not in installed, f"binder installs {req.name} twice (requirements.txt and postBuild)"
            installed[name] = req

    missing = sorted(set(expected) - set(installed))
    extra = sorted(set(installed) - set(expected))
    assert not missing, f"binder does not install {missing}, which the README's install command does"
    assert not extra, f"binder installs {extra}, which pyproject/README do not: add them there or remove them here"
    for name, req in expected.items():
        got = installed[name]
        assert got.specifier == req.specifier, f"{name}: binder asks for {got}, pyproject for {req}"
        assert got.extras == req.extras and got.marker == req.marker, f"{name}: {got} vs {req}"

    # nbaccel itself, from the checkout, with the README's extras.
    assert repo_installs, "postBuild does not install nbaccel from the repository (pip install -e .)"
    match = re.fullmatch(r"-e \.(?:\[([^\]]*)\])?", repo_installs[-1])
    assert match, f"postBuild installs the repository as {repo_installs[-1]!r}; expected -e . with the README's extras"
    assert {e.strip() for e in (match.group(1) or "").split(",") if e.strip()} == _readme_extras()


def test_torch_comes_from_the_cpu_wheel_index_before_nbaccel():
    installs = _postbuild_pip_installs()
    torch_steps = [i for i, args in enumerate(installs)
                   if any(canonicalize_name(Requirement(p).name) == "torch"
                          for p in _split_install(args)[0] if not p.startswith(("-e ", ".")))]
    assert torch_steps, "postBuild does not install torch"
    for i in torch_steps:
        _, options = _split_install(installs[i])
        index = options.get("--index-url") or options.get("-i")
        assert index == CPU_INDEX, f"torch must come from {CPU_INDEX} (only the CPU build), not {index or 'PyPI'}"
    repo_steps = [i for i, args in enumerate(installs) if any(p.startswith(("-e ", ".")) for p in _split_install(args)[0])]
    assert repo_steps and min(torch_steps) < min(repo_steps), \
        "install the CPU torch before nbaccel, or pip pulls the CUDA build from PyPI to satisfy nbaccel's dependency"


def test_readme_has_the_binder_badge_opening_the_quickstart():
    readme = _readme()
    assert BADGE in readme, f"README.md needs the Binder badge, exactly:\n{BADGE}"
    assert readme.index(BADGE) < readme.index("<!-- test-command -->"), "the Binder badge belongs near the top"
    labpath = re.search(r"labpath=([^)\s]+)", BADGE_URL).group(1).replace("%2F", "/")
    assert (ROOT / labpath).is_file(), f"the badge opens {labpath}, which does not exist"
    # Every mybinder link in the README uses the same repository, ref and notebook.
    for url in re.findall(r"https://mybinder\.org/v2/[^)\s\"]+", readme):
        assert url == BADGE_URL, f"a Binder link differs from the badge: {url}"
