"""The tracer's argument-tree helpers agree with torch's pytree where they overlap."""

import torch
from torch.utils._pytree import tree_leaves

from decompshard._compat import TensorMeta
from decompshard.dispatch_modes.graph import freeze, leaves, map_leaves

TREES = [
    ((torch.randn(2), [torch.randn(3), 4, None]), {"dim": 1, "out": torch.randn(1)}),
    torch.aminmax(torch.randn(5)),  # a torch.return_types result: its tensors are leaves
    ([[1, 2], (3.0, "x")], {}),
]


def test_leaves_match_torch_pytree():
    for tree in TREES:
        assert [id(x) for x in leaves(tree)] == [id(x) for x in tree_leaves(tree)]


def test_tensor_meta_and_size_are_leaves_and_map_keeps_structure():
    tm = TensorMeta((2, 3), (3, 1), torch.float32)
    tree = ((tm, torch.Size([4])), {"b": [1, 2], "a": tm})
    assert leaves(tree) == [tm, torch.Size([4]), 1, 2, tm]  # torch's pytree would split the Size
    assert map_leaves(lambda x: x, tree) == tree
    assert map_leaves(lambda x: 0 if isinstance(x, int) else x, tree)[1]["b"] == [0, 0]
    assert freeze({"b": [1], "a": tm}) == freeze({"a": tm, "b": (1,)})
    hash(freeze(tree))
