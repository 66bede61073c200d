"""Fixtures of the Triton kernels' tests (``test_evolution.py``, ``test_attention_tail.py``)."""

import os

import pytest
import torch
from testing import INTERPRETER_TRITON

from ea_hf.modeling.versions import release

try:  # the test modules skip themselves without triton (pytest.importorskip)
    import triton
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None

#: TRITON_INTERPRET as the session had it: the kernels' test modules set it to 1 when they are imported (before
#: they import triton, where they do so first; see test_evolution.py) and it is restored after each module.
_INTERPRET_BEFORE = os.environ.get("TRITON_INTERPRET")


@pytest.fixture(autouse=True, scope="module")
def restore_interpret_setting():
    yield
    if _INTERPRET_BEFORE is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _INTERPRET_BEFORE


#: Triton's interpreter runs the kernels from 3.9 on; 3.6's fails in them ("only 0-dimensional arrays can be
#: converted to Python scalars"), though 3.6 compiles them for a GPU.
INTERPRETER_RUNS_THE_KERNELS = triton is not None and release(triton.__version__) >= release(INTERPRETER_TRITON)


@pytest.fixture(
    params=[
        pytest.param(
            "cpu",
            marks=pytest.mark.skipif(
                not INTERPRETER_RUNS_THE_KERNELS,
                reason=f"triton {getattr(triton, '__version__', None)}'s interpreter fails in the kernels",
            ),
        ),
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(
                not torch.cuda.is_available(), reason="compiled kernels need a CUDA GPU (the interpreter runs on CPU)"
            ),
        ),
    ]
)
def device(request):
    """Where the Triton kernels run: ``cpu`` in Triton's interpreter, ``cuda`` compiled."""
    return request.param
