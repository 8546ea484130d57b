"""The package's layers import only downward (docs/architecture.md), counting imports inside
functions too: the store knows nothing above it, distributed/ no Lightning layer, and so on."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_embcache

PKG = Path(lightning_embcache.__file__).parent

# lowest first; a module may import its own layer and those before it
LAYERS = [
    ("store", "native"),
    ("optim", "pinned", "mapped_host", "mapped_swap", "device_slots", "device_ahead", "device_tier", "host_mapped_tier", "trainable", "data"),
    ("distributed",),
    ("lightning", "profiling"),
    ("cli", "demo", "tools", "__init__", "__main__"),
]


def _layer(parts: tuple[str, ...]) -> int:
    head = parts[0].removesuffix(".py")
    for i, names in enumerate(LAYERS):
        if head in names:
            return i
    raise AssertionError(f"module {'/'.join(parts)} is in no layer: add it to LAYERS and docs/architecture.md")


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    pkg = path.relative_to(PKG).parent.parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = pkg[: len(pkg) - node.level + 1]
                out.append(".".join(("lightning_embcache", *base, *([node.module] if node.module else []))))
            elif node.module:
                out.append(node.module)
    return [m for m in out if m == "lightning_embcache" or m.startswith("lightning_embcache.")]


def test_every_module_imports_only_its_layer_and_those_below():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).parts
        mine = _layer(rel)
        for mod in _imports(path):
            parts = tuple(mod.split(".")[1:])
            if not parts:  # the package itself: the top layer's re-exports
                if mine < len(LAYERS) - 1:
                    wrong.append(f"{'/'.join(rel)} imports lightning_embcache (the public API, top layer)")
                continue
            theirs = _layer(parts)
            if theirs > mine:
                wrong.append(f"{'/'.join(rel)} (layer {mine}) imports {mod} (layer {theirs})")
    assert not wrong, "\n".join(wrong)
