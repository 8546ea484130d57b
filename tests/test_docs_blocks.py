"""Every ```python block of README.md and docs/*.md runs, as a reader would run it.

Conventions for the pages:
* The blocks of one page run in order, in one namespace, in a fresh Python process (started with
  only this checkout on ``PYTHONPATH``) and an empty temporary working directory, with
  ``__name__ == "__main__"``: a later block may use what an earlier one defined, exactly as when
  the reader pastes the page's blocks into one script. Nothing is silenced or patched.
* ```bash blocks run too, in the same folder, between the python blocks around them (``embcache``
  is this checkout's command).
* A block that is a fragment (it needs the reader's own data, a GPU, or a running Trainer), or a
  command that installs or benchmarks, is fenced ```python no-run (```bash no-run): it is still
  highlighted, and this test only checks that a python one parses. Keep them few: a reader can
  only trust a page whose blocks run.
* A block may shrink sizes for the test with a trailing comment `# docs-test: NAME=VALUE`
  replacing that assignment; none do today, keep pages copy-pasteable.
The page fails on the first block that raises, naming the page and the block's line.

``python tests/test_docs_blocks.py docs/getting-started.md`` runs one page the same way by hand.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(python|bash)([^\n]*)\n(.*?)^```", re.S | re.M)
# pages whose blocks would take too long for the default suite (none: getting-started takes ~15 s)
SLOW_PAGES: set[str] = set()


def blocks(page: Path, lang: str = "python") -> list[tuple[int, str, str]]:
    """(line, info string after the language, code) for every `lang` block of `page`."""
    return [(line, info, code) for line, lg, info, code in all_blocks(page) if lg == lang]


def all_blocks(page: Path) -> list[tuple[int, str, str, str]]:
    """(line, language, info string, code) for every python and bash block of `page`, in order."""
    text = page.read_text()
    return [(text[: m.start()].count("\n") + 1, m.group(1), m.group(2).strip(), m.group(3))
            for m in FENCE.finditer(text)]


def _run_bash(code: str, where: str) -> None:
    """A bash block as the reader types it, with ``embcache`` being this checkout's command."""
    prelude = f'set -e\nembcache() {{ "{sys.executable}" -m lightning_embcache "$@"; }}\n'
    proc = subprocess.run(["bash", "-c", prelude + code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=600)
    print(proc.stdout, flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"bash exited {proc.returncode}")


def run_page(page: Path) -> int:
    """Run `page`'s blocks in order in this process (the test's child); 0 if all ran."""
    namespace: dict[str, object] = {"__name__": "__main__"}
    for line, lang, info, code in all_blocks(page):
        where = f"{page.name}:{line}"
        if lang == "python":
            tree = compile(code, where, "exec", flags=ast.PyCF_ONLY_AST)  # every block must at least parse
        if info == "no-run":
            continue
        try:
            if lang == "bash":
                _run_bash(code, where)
            else:
                exec(compile(tree, where, "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - report any failure of the reader's script
            traceback.print_exc()
            print(f"DOCS-BLOCK-FAILED the {lang} block at {where} raised {type(exc).__name__}: {exc} (a fragment "
                  "that is not meant to run is fenced ```python no-run; see tests/test_docs_blocks.py)", flush=True)
            return 1
    return 0


def test_the_fence_convention_is_used_consistently():
    for page in PAGES:
        for line, lang, info, _ in all_blocks(page):
            assert info in ("", "no-run"), f"{page.name}:{line}: unknown {lang} fence info {info!r}"


# pages a new user follows step by step: every python block runs (no fragments)
GUIDES = ("getting-started.md", "lightning.md", "troubleshooting.md")


def test_the_guides_have_no_python_fragments():
    for name in GUIDES:
        fragments = [line for line, info, _ in blocks(ROOT / "docs" / name) if info == "no-run"]
        assert not fragments, f"docs/{name}: python blocks fenced no-run at lines {fragments}; make them run"


def _page_params():
    for p in PAGES:
        if [b for b in all_blocks(p) if b[2] != "no-run"]:
            marks = [pytest.mark.slow] if p.name in SLOW_PAGES else []
            yield pytest.param(p, id=p.name, marks=marks)


@pytest.mark.timeout(900)  # a page trains and compiles models in a fresh interpreter: minutes on a loaded host
@pytest.mark.parametrize("page", list(_page_params()))
def test_every_python_block_runs(page, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "COV_"))}
    env.update(PYTHONPATH=str(ROOT), PYTHONHASHSEED="0")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(page)], cwd=tmp_path, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
    failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("DOCS-BLOCK-FAILED")]
    assert proc.returncode == 0, (failed[0] if failed else f"{page.name}: exit {proc.returncode}") + \
        "\n" + proc.stdout[-6000:]


def test_a_failing_block_is_reported_with_its_page_and_line(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# t\n\n```python\nx = 1\n```\n\n```python\nassert x == 2, 'x is 1'\n```\n")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(page)], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "DOCS-BLOCK-FAILED the python block at page.md:7 raised AssertionError" in proc.stdout


def test_bash_blocks_run_in_order_with_the_python_ones(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("```python\nopen('made.txt', 'w').write('x')\n```\n\n```bash\ntest -f made.txt\n"
                    "embcache --version\n```\n\n```bash no-run\nexit 3\n```\n\n```bash\ntest -f missing.txt\n```\n")
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), str(page)], cwd=tmp_path,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "DOCS-BLOCK-FAILED the bash block at page.md:14 raised" in proc.stdout


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


if __name__ == "__main__":
    sys.exit(run_page(Path(sys.argv[1]).resolve()))
