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


@pytest.fixture
def hopper(monkeypatch):
    """A CUDA GPU of compute capability 9 (an H100 or H200) as the default's judgement sees it, without a GPU."""
    monkeypatch.setattr(common, "_capability_major", lambda device: 9)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.delenv("EA_HF_TRITON", raising=False)


CUDA = torch.device("cuda")


@pytest.mark.skipif(common.triton is None, reason="triton >= 3.6 is not installed: no kernel is ever enabled")
def test_unset_the_kernels_take_half_precision_maps_on_hopper_and_nothing_else(hopper, monkeypatch):
    assert [common.enabled(CUDA, dtype) for dtype in (torch.bfloat16, torch.float16, torch.float32)] == [
        True, True, False,
    ]  # fmt: skip
    # The CPU takes them only when asked for, under the interpreter; other devices never.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not common.enabled(torch.device("cpu"), torch.bfloat16)
    assert not common.enabled(torch.device("meta"), torch.bfloat16)
    # GPUs no decision table measured, and ROCm, keep torch operations.
    monkeypatch.setattr(common, "_capability_major", lambda device: 8)
    assert not common.enabled(CUDA, torch.bfloat16)
    monkeypatch.setattr(common, "_capability_major", lambda device: 9)
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not common.enabled(CUDA, torch.bfloat16)


@pytest.mark.skipif(common.triton is None, reason="triton >= 3.6 is not installed: no kernel is ever enabled")
def test_the_variable_overrides_the_default_both_ways(hopper, monkeypatch):
    monkeypatch.setenv("EA_HF_TRITON", "0")
    assert not common.enabled(CUDA, torch.bfloat16)
    assert not kernels.applicable(MAPS.to(torch.bfloat16), weight=WEIGHT.to(torch.bfloat16))
    monkeypatch.setenv("EA_HF_TRITON", "1")
    monkeypatch.setattr(common, "_capability_major", lambda device: 8)
    assert common.enabled(CUDA, torch.float32)
    monkeypatch.setenv("EA_HF_TRITON", "")  # empty is unset
    assert not common.enabled(CUDA, torch.float32)


@pytest.mark.parametrize("value", ["true", "2", "yes"])
def test_a_value_other_than_0_or_1_is_an_error_that_names_them(monkeypatch, value):
    monkeypatch.setenv("EA_HF_TRITON", value)
    with pytest.raises(ValueError, match=rf"EA_HF_TRITON='{value}': expected 1 \(the Triton kernels\), 0"):
        common.requested()


def test_without_a_usable_triton_the_default_takes_nothing(hopper, too_old_triton):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: nobody asked for the kernels
        assert not common.enabled(CUDA, torch.bfloat16)
        assert not kernels.applicable(MAPS.to(torch.bfloat16), weight=WEIGHT.to(torch.bfloat16))
