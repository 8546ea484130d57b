"""DeferredSync tells the user what is wrong instead of doing nothing or failing later."""

from __future__ import annotations

import pytest
from _everyday_model import trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_embcache import DeferredSync


def test_deferred_sync_on_a_module_without_the_mixin_is_an_error(tmp_path):
    with pytest.raises(MisconfigurationException, match="BoringModel does not have it"):
        trainer(tmp_path, max_steps=1, callbacks=[DeferredSync()]).fit(BoringModel())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(every_n_steps="10"), TypeError, r"every_n_steps='10'. Must be an int >= 1 or None, got str"),
    (dict(every_n_epochs=1.5), TypeError, r"every_n_epochs=1.5. Must be an int"),
    (dict(every_n_steps=True), TypeError, r"every_n_steps=True"),
    (dict(every_n_steps=0), ValueError, r"every_n_steps=0. Must be >= 1"),
    (dict(background="yes"), TypeError, r"background='yes'. Must be True or False"),
])
def test_deferred_sync_rejects_bad_arguments_by_name(kwargs, error, message):
    with pytest.raises(error, match=message):
        DeferredSync(**kwargs)


def test_deferred_sync_on_in_memory_stores_only_warns(tmp_path):
    from _everyday_model import Model, data

    with pytest.warns(UserWarning, match="no embedding store with a path"):
        trainer(tmp_path, max_steps=1, callbacks=[DeferredSync()]).fit(Model(None, "get"), data())
