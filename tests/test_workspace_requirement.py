"""WorkspaceRequirement: what a backend asks the core to allocate is checked where it is made.

A shape is a tuple of sizes: non-negative ints, any integer type a sizing formula may give
(numpy's included), never a bool (``True`` would allocate one element in silence) and never a
bare int (``shape=5`` is not a 1-D shape). Each refusal names the buffer and what came.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from attn_core.context import WorkspaceRequirement


def test_sizes_of_any_integer_type_are_taken_as_python_ints():
    req = WorkspaceRequirement("ws", (np.int64(4), np.int32(3), 2), torch.float32)
    assert req.shape == (4, 3, 2) and all(type(s) is int for s in req.shape)
    assert req.nbytes == 4 * 3 * 2 * 4


@pytest.mark.parametrize(
    "shape, words",
    [
        ((True, 4), "True"),
        ((4, -1), "-1"),
        ((4, 2.0), "2.0"),
        (5, "5"),
        ("64", "'64'"),
        (None, "None"),
    ],
    ids=["bool", "negative", "float", "bare-int", "str", "none"],
)
def test_a_shape_that_is_not_a_tuple_of_sizes_is_refused_by_name(shape, words):
    with pytest.raises(ValueError) as info:
        WorkspaceRequirement("scratch", shape)
    msg = str(info.value)
    assert "'scratch'" in msg and words in msg and "sizes" in msg, msg
