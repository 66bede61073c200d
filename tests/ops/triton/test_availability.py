"""What the Triton kernels (``ea_hf.ops.triton``) do where triton is missing or too old (runs with or without it)."""

import warnings

import pytest
import torch

from ea_hf.modeling.architectures import release
from ea_hf.ops.triton import common
from ea_hf.ops.triton import evolution as kernels

MAPS = torch.zeros(1, 2, 8, 8)
WEIGHT = torch.zeros(2, 2, 3, 3)


@pytest.fixture
def too_old_triton(monkeypatch):
    """triton 3.4 installed, as torch 2.8 installs it with itself."""
    monkeypatch.setattr(common, "triton", None)
    monkeypatch.setattr(common, "TOO_OLD_TRITON", "3.4.0")


def test_a_too_old_triton_is_declined_with_a_warning_where_the_kernels_were_asked_for(monkeypatch, too_old_triton):
    monkeypatch.setenv("EA_HF_TRITON", "1")
    with pytest.warns(UserWarning, match=r"triton 3\.4\.0 is older than the 3\.6 the kernels need"):
        assert kernels.applicable(MAPS, weight=WEIGHT) is False


def test_a_too_old_triton_is_declined_silently_without_the_opt_in(monkeypatch, too_old_triton):
    monkeypatch.setenv("EA_HF_TRITON", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernels.applicable(MAPS, weight=WEIGHT) is False


@pytest.mark.parametrize(("version", "usable"), [("3.2.0", False), ("3.5.1", False), ("3.6.0", True), ("3.10.0", True)])
def test_the_floor_compares_release_numbers_not_strings(version, usable):
    assert (release(version) >= release(common.MIN_TRITON)) is usable
