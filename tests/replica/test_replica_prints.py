"""A replica's fingerprint: the bits of every dtype summed exactly, read back in order."""

from __future__ import annotations

import pytest
import torch

from rankguard.callbacks.replica.layout import ReplicaSet, set_key
from rankguard.callbacks.replica.prints import (
    SAMPLED,
    bits,
    digest,
    launch,
    sample,
    step_counter,
)

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.bool,
    torch.complex64,
]


def _sum(tensor: torch.Tensor) -> int:
    return int(torch.sum(bits(tensor), dtype=torch.int64))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_one_changed_element_changes_the_sum_in_every_dtype(dtype):
    tensor = (torch.arange(64) % 7 == 0) if dtype == torch.bool else torch.randn(64).to(dtype)
    changed = tensor.clone()
    if dtype == torch.bool:
        changed[5] = not bool(changed[5])
    elif dtype.is_floating_point:
        # the smallest change there is: the next representable value
        changed[5] = torch.nextafter(changed[5], torch.tensor(float("inf"), dtype=dtype))
    else:
        changed[5] = changed[5] + 1
    assert _sum(tensor) == _sum(tensor.clone()) and _sum(changed) != _sum(tensor)


def test_a_sign_or_a_nan_changes_the_sum_a_float_sum_would_not_see():
    tensor = torch.tensor([0.0, 1.0])
    assert _sum(torch.tensor([-0.0, 1.0])) != _sum(tensor)
    assert _sum(torch.tensor([float("nan"), 1.0])) != _sum(tensor)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_tensors_are_read_without_a_copy_as_words_or_as_elements(dtype):
    tensor = torch.randn(8, 8).to(dtype)
    assert bits(tensor).dtype == torch.int64  # contiguous: its 8-byte words
    assert bits(tensor).data_ptr() == tensor.data_ptr()
    odd = tensor.reshape(-1)[1:4]  # 3 elements at an offset: not whole, aligned words
    assert bits(odd).dtype != torch.int64 and bits(odd).data_ptr() == odd.data_ptr()
    strided = tensor.t()  # strided: its elements
    assert bits(strided).dtype != torch.int64 and bits(strided).data_ptr() == tensor.data_ptr()
    for view in (tensor, odd, strided):
        changed, first = view.clone(), (0,) * view.dim()  # a clone keeps the strides
        changed[first] = torch.nextafter(changed[first], torch.tensor(9.0, dtype=dtype))
        assert _sum(changed) != _sum(view.clone())


def test_launch_reads_each_sets_sums_in_order_and_digests_them():
    a, b, c = torch.randn(3, 2), torch.randn(5), torch.ones(2, dtype=torch.bfloat16)
    sets = [
        ReplicaSet((0, 1), set_key((0, 1)), "ddp", "DDP", ["a", "b"], [a, b]),
        ReplicaSet((0, 2), set_key((0, 2)), "mesh", "mesh", ["c"], [c]),
    ]
    launched = launch(sets)
    printed, sums = launched.read(step=7)
    assert sums == [_sum(a), _sum(b), _sum(c)]
    assert printed.step == 7 and printed.optimizer_steps is None
    assert printed.digests == {
        set_key((0, 1)): digest(sums[:2]),
        set_key((0, 2)): digest(sums[2:]),
    }


def test_the_optimizers_step_count_goes_with_the_print():
    param = torch.nn.Parameter(torch.randn(3))
    adam = torch.optim.Adam([param])
    assert step_counter(adam) is None  # no step yet
    for _ in range(3):
        param.grad = torch.ones(3)
        adam.step()
    assert int(step_counter(adam)) == 3
    sets = [ReplicaSet((0, 1), set_key((0, 1)), "ddp", "DDP", ["p"], [param])]
    assert launch(sets, adam).read(step=3)[0].optimizer_steps == 3
    sgd = torch.optim.SGD([param], lr=0.1)  # no momentum: no state, no count
    sgd.step()
    assert step_counter(sgd) is None
    assert step_counter(object()) is None


def test_a_sample_reads_small_tensors_whole_and_large_ones_evenly():
    small = sample("w", torch.arange(6.0).reshape(2, 3))
    assert small == ("w", (2, 3), [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], False)
    large = sample("v", torch.arange(float(3 * SAMPLED)))
    assert large.sampled and len(large.values) == SAMPLED
    assert large.values[0] == 0.0 and large.values[-1] == 3 * SAMPLED - 1
