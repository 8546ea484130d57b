"""Write docs/api.md from the docstrings of the public API (`lightning_embcache.__all__`).

    python tools/gen_api_docs.py            # rewrite docs/api.md
    python tools/gen_api_docs.py --check    # exit 1 if docs/api.md is not what this would write

tests/test_api_docs.py runs the check, so a changed docstring or signature needs `make docs-api`.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # document this source tree, not an installed copy

import lightning_embcache  # noqa: E402
from lightning_embcache.lightning import EmbeddingStoreHandle  # noqa: E402

OUT = Path(__file__).resolve().parents[1] / "docs" / "api.md"

# Also documented: returned by add_embedding_store, never constructed by users.
EXTRA = {"EmbeddingStoreHandle": EmbeddingStoreHandle}
SECTIONS = [
    ("Store", ["EmbeddingStore", "StoreStats"]),
    ("Lightning", ["EmbeddingStoreMixin", "EmbeddingStoreHandle", "DeferredSync", "MemoryPressure", "StepProfiler"]),
    ("Trainable rows and optimizers", ["TrainableRows", "trainable_fields", "RowOptimizer", "make_row_optimizer"]),
    ("Errors", None),  # every exception class in __all__
]
NOT_CONSTRUCTED = {"EmbeddingStore", "EmbeddingStoreHandle"}  # made by create()/open(), add_embedding_store()
HOOKS = {"setup", "teardown", "state_dict", "load_state_dict", "state_key", "configure_callbacks"}


def _signature(obj: object) -> str:
    """``(a: int, b: str = 'x') -> T`` without ``self``/``cls`` and with annotations unquoted."""
    try:
        sig = inspect.signature(obj)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    parts, star_done = [], False
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    for p in params:
        if p.kind is p.VAR_POSITIONAL:
            text, star_done = f"*{p.name}", True
        elif p.kind is p.VAR_KEYWORD:
            text = f"**{p.name}"
        else:
            if p.kind is p.KEYWORD_ONLY and not star_done:
                parts.append("*")
                star_done = True
            text = p.name
        if p.annotation is not p.empty:
            text += f": {_annotation(p.annotation)}"
        if p.default is not p.empty:
            text += f" = {p.default!r}" if p.annotation is not p.empty else f"={p.default!r}"
        parts.append(text)
    out = f"({', '.join(parts)})"
    if sig.return_annotation is not sig.empty:
        out += f" -> {_annotation(sig.return_annotation)}"
    return re.sub(r" at 0x[0-9a-f]+", "", out)


def _annotation(a: object) -> str:
    text = a if isinstance(a, str) else inspect.formatannotation(a)
    return text.strip("'\"")


def _doc(obj: object) -> str:
    return inspect.cleandoc(inspect.getdoc(obj) or "").strip()


def public_members(cls: type) -> list[tuple[str, object]]:
    """Every public method and property of ``cls``, its own and those of its bases inside this
    package (not Lightning's or Python's), first definition in the MRO winning, in definition order."""
    members: dict[str, object] = {}
    for klass in cls.__mro__:
        if not klass.__module__.startswith("lightning_embcache"):
            continue
        for name, value in klass.__dict__.items():
            if name in members or (name.startswith("_") and name not in ("__init__", "__enter__")):
                continue
            if name in HOOKS or name.startswith("on_"):  # Lightning hooks: called by the Trainer
                continue
            if isinstance(value, (staticmethod, classmethod)):
                value = getattr(cls, name)  # bound: its signature has no cls
            if (callable(value) or isinstance(value, property)) and name != "__init__":
                members[name] = value
    return list(members.items())


def _public_members(cls: type) -> list[tuple[str, object]]:
    return [(n, v) for n, v in public_members(cls) if _doc(v)]


def _render(name: str, obj: object) -> list[str]:
    lines = [f"### `{name}`", ""]
    if inspect.isclass(obj):
        if name not in NOT_CONSTRUCTED:
            lines += ["```", f"{name}{_signature(obj)}", "```", ""]
        lines += [_doc(obj), ""] if _doc(obj) else []
        if issubclass(obj, BaseException):
            return lines
        for member, value in _public_members(obj):
            if isinstance(value, property):
                lines += [f"#### `{name}.{member}` (property)", "", _doc(value), ""]
            else:
                lines += [f"#### `{name}.{member}{_signature(value)}`", "", _doc(value), ""]
    else:
        lines += ["```", f"{name}{_signature(obj)}", "```", "", _doc(obj), ""]
    return lines


def render() -> str:
    names = {n: getattr(lightning_embcache, n) for n in lightning_embcache.__all__}
    names.update(EXTRA)
    lines = ["# API reference", "",
             "Generated from the docstrings by `tools/gen_api_docs.py` (`make docs-api`); do not edit by hand.",
             "Everything here is importable from `lightning_embcache`, except `EmbeddingStoreHandle`, which",
             "`add_embedding_store` returns. Guides: [getting-started.md](getting-started.md),",
             "[concepts.md](concepts.md), [lightning.md](lightning.md), [store.md](store.md).", ""]
    done: set[str] = set()
    for title, wanted in SECTIONS:
        if wanted is None:
            wanted = sorted(n for n, o in names.items() if inspect.isclass(o) and issubclass(o, BaseException))
        lines += [f"## {title}", ""]
        for name in wanted:
            if name in names and name not in done:
                lines += _render(name, names[name])
                done.add(name)
    rest = sorted(set(names) - done)
    if rest:
        lines += ["## Other", ""]
        for name in rest:
            lines += _render(name, names[name])
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run `make docs-api` (python tools/gen_api_docs.py)", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
