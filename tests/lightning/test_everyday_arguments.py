"""Bad arguments through `add_embedding_store`, as a new user types them: a named error, the allowed
values, the argument probably meant, and no trace left behind."""

from __future__ import annotations

import pytest
import torch
from _lightning_helpers import tiny_model

from lightning_embcache import InvalidArgumentError


def _add(tmp_path, **kwargs):
    model = tiny_model(tmp_path / "latents")
    with pytest.raises(InvalidArgumentError) as err:
        model.add_embedding_store("codes", 100, 8, path=tmp_path / "codes", **kwargs)
    assert list(model.embedding_stores) == ["latents"]  # nothing added
    assert not (tmp_path / "codes").exists()  # nothing made
    return str(err.value), err.value


def test_an_unknown_optimizer_names_the_allowed_ones_and_the_near_miss(tmp_path):
    msg, _ = _add(tmp_path, optimizer="lamb")
    assert "optimizer='lamb'" in msg
    for name in ("'sgd'", "'adagrad'", "'rowwise_adagrad'", "'adam'", "'adamw'"):
        assert name in msg
    msg, _ = _add(tmp_path, optimizer="adamm", lr=0.1)
    assert "did you mean optimizer='adam'" in msg


def test_a_misspelt_store_argument_is_named_as_a_store_argument(tmp_path):
    for extra in ({}, {"optimizer": "adam", "lr": 0.1}):
        msg, err = _add(tmp_path, hot_byte=1 << 20, **extra)
        assert "hot_byte=" in msg and "did you mean hot_bytes=?" in msg
        assert "of the optimizer" not in msg and "for optimizer" not in msg
        assert isinstance(err, TypeError)  # an unknown keyword is a TypeError too, as Python's own


def test_an_option_of_another_optimizer_says_which_optimizer_takes_it(tmp_path):
    msg, _ = _add(tmp_path, optimizer="adam", lr=0.1, momentum=0.9)
    assert "momentum" in msg and "'sgd'" in msg
    msg, _ = _add(tmp_path, betas=(0.9, 0.99))  # an optimizer option without optimizer=
    assert "optimizer=" in msg


def test_an_unknown_if_exists_is_an_invalid_argument_with_the_allowed_values(tmp_path):
    msg, _ = _add(tmp_path, if_exists="append")
    assert "if_exists='append'" in msg and "'error', 'resume', 'overwrite'" in msg
    msg, _ = _add(tmp_path, if_exists="resum")
    assert "did you mean if_exists='resume'" in msg


def test_hot_bytes_below_one_record_is_refused_with_the_record_size(tmp_path):
    msg, _ = _add(tmp_path, hot_bytes=1)
    assert "hot_bytes=1" in msg and f"{8 * 4 + 11} bytes" in msg
    msg, _ = _add(tmp_path, hot_bytes=100, optimizer="adam", lr=0.1)  # Adam's moments make a record larger
    assert "hot_bytes=100" in msg
    model = tiny_model(tmp_path / "latents")
    handle = model.add_embedding_store("codes", 100, 8, path=tmp_path / "codes", hot_bytes=43)  # exactly one
    assert handle.get(torch.arange(3)).shape == (3, 8)


def test_a_duplicate_name_is_an_invalid_argument_listing_the_names(tmp_path):
    model = tiny_model(tmp_path / "latents")
    with pytest.raises(InvalidArgumentError, match="latents"):
        model.add_embedding_store("latents", 10, 4)

