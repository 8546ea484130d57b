"""Every ```python block of README.md and docs/*.md runs.

Conventions for the pages:
* The blocks of one page run in order in one namespace, in an empty temporary working directory,
  so a later block may use what an earlier one defined (as a reader would type them).
* A block that is a fragment (it needs the reader's own data, a GPU, or a running Trainer) is
  fenced ```python no-run: it is still highlighted as Python, and this test only checks that it
  parses.
* A block may shrink sizes for the test with a trailing comment `# docs-test: NAME=VALUE`
  replacing that assignment; none do today, keep pages copy-pasteable.
Lightning's progress bars and banners are silenced; the page fails on the first block that raises.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```", re.S | re.M)


def blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line, info string after 'python', code) for every python block of `page`."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1).strip(), m.group(2)) for m in FENCE.finditer(text)]


def test_the_fence_convention_is_used_consistently():
    for page in PAGES:
        for line, info, _ in blocks(page):
            assert info in ("", "no-run"), f"{page.name}:{line}: unknown python fence info {info!r}"


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    namespace: dict[str, object] = {"__name__": f"docs_{page.stem.replace('-', '_')}"}
    for line, info, code in blocks(page):
        where = f"{page.relative_to(ROOT)}:{line}"
        tree = compile(code, where, "exec", flags=ast.PyCF_ONLY_AST)  # every block must at least parse
        if info == "no-run":
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                exec(compile(tree, where, "exec"), namespace)
            except Exception as exc:
                raise AssertionError(
                    f"the python block at {where} raised {type(exc).__name__}: {exc} (a fragment that is not "
                    "meant to run is fenced ```python no-run; see tests/test_docs_blocks.py)") from exc
    os.chdir(ROOT)


def test_the_api_reference_is_generated_from_the_current_docstrings():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gen_api_docs", ROOT / "tools" / "gen_api_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert (ROOT / "docs" / "api.md").read_text() == gen.render(), (
        "docs/api.md is out of date: run `make docs-api` (python tools/gen_api_docs.py)")


@pytest.mark.slow  # builds a wheel (a few seconds, writes build/ in the source tree, which git ignores)
def test_the_wheel_carries_the_docs_license_types_and_one_version(tmp_path):
    import subprocess
    import sys
    import zipfile

    import lightning_embcache

    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("lightning_embcache-*.whl")
    assert wheel.name.startswith(f"lightning_embcache-{lightning_embcache.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    data = f"lightning_embcache-{lightning_embcache.__version__}.data/data/share/doc/lightning_embcache/"
    assert "lightning_embcache/py.typed" in names
    for page in ["README.md", "CHANGELOG.md", "LICENSE", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]:
        assert data + page in names, page
