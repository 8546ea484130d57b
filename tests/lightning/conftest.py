"""Quiet two Lightning warnings every test here would otherwise print (they are about Lightning, not us)."""

import pytest

_IGNORE = (
    "ignore:.*manual optimization and every_n_train_steps.*",
    "ignore:.*isinstance.treespec, LeafSpec.*",
    "ignore:.*does not have many workers.*",
)


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/lightning/" in str(item.path).replace("\\", "/"):
            for rule in _IGNORE:
                item.add_marker(pytest.mark.filterwarnings(rule))
