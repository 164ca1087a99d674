"""The repository stands on its own: no file names a path of a development machine or a folder outside the
repository, the architecture it cites is in it (docs/DESIGN.md, linked from the README), and a regular (not
editable) install ships every subpackage."""

import re
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# absolute paths of a developer's machine, and the shared folder beside a checkout
OUTSIDE = re.compile(r"(?<![\w.])(/work/|/home/\w|/root/|/Users/\w|/private/var/|[A-Z]:\\\\Users|\.\./shared\b)")
TEXT = (".py", ".md", ".toml", ".j2", ".txt", ".cfg", ".ini", ".sh", ".json", ".yaml", ".yml", "Makefile", "run")


def tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if out.returncode != 0:  # not a git checkout (an sdist): every file below the repository
        return [p for p in REPO.rglob("*") if p.is_file() and ".venv" not in p.parts and ".git" not in p.parts]
    return [REPO / line for line in out.stdout.splitlines()]


def test_no_file_names_a_path_outside_the_repository():
    hits = []
    for path in tracked():
        if not path.name.endswith(TEXT) or path.name == "test_repo_hygiene.py" or not path.is_file():
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def test_the_architecture_is_in_the_repository():
    design = REPO / "docs" / "DESIGN.md"
    assert design.is_file() and "## 4. Stage contracts" in design.read_text()
    assert "docs/DESIGN.md" in (REPO / "README.md").read_text()
    sections = set(re.findall(r"^#+ (\d+(?:\.\d+)?)\.? ", design.read_text(), re.M))
    cited = set()
    for path in tracked():
        if path.suffix == ".py" and path.is_file():
            cited |= set(re.findall(r"docs/DESIGN\.md (\d+(?:\.\d+)?)", path.read_text(errors="replace")))
    assert cited and cited <= sections, sorted(cited - sections)


def test_the_package_is_laid_out_as_imported():
    """A file's path tells its import name (megatrain/runtime/engine.py is megatrain.runtime.engine): one
    package folder, found whole by setuptools (a hand-kept package list once missed megatrain.models.depth and
    made every command of a regular install fail to import), and no project code outside it."""
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in setup and setup["packages"]["find"]["include"] == ["megatrain*"]
    stray = [p for p in tracked() if p.suffix == ".py" and p.parts[len(REPO.parts)] not in
             ("megatrain", "tests", "benchmarks", "examples")]
    assert not stray, stray


def test_every_relative_link_in_the_prose_points_to_a_file():
    """Every relative link of README.md and docs/ (pages and logs; images included; code blocks and URLs left out)
    names a file or folder of the repository, so moving prose between pages cannot leave a link dangling."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists() or REPO not in (path, *path.parents):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "\n".join(broken)
