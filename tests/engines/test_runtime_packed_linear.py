"""Packed linear layers compute what ``nn.Linear`` computes, and the swap is complete."""

import pytest
import torch

from engines.runtime.packed_linear import PackedLinear, can_pack, pack_linears, padded_rows

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


BF16 = pytest.param(torch.bfloat16, 3e-2, marks=pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="this CPU has no oneDNN bf16 kernels (AVX-512)"))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), BF16])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_nn_linear(dtype: torch.dtype, tol: float, bias: bool) -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 40, bias=bias).to(dtype)
    packed = PackedLinear(linear, batch_hint=8)
    with torch.inference_mode():
        for shape in [(1, 96), (7, 96), (2, 5, 96), (3, 1, 96)]:
            x = torch.randn(*shape).to(dtype)
            want, got = linear(x), packed(x)
            assert got.shape == want.shape and got.dtype == dtype
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_strided_input() -> None:
    linear = torch.nn.Linear(16, 8)
    packed = PackedLinear(linear, batch_hint=4)
    x = torch.randn(16, 6).t()
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_swaps_every_linear_once() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Sequential(torch.nn.Linear(16, 4)))
    x = torch.randn(3, 8)
    with torch.inference_mode():
        want = model(x)
        assert pack_linears(model) == 2
        assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
        assert pack_linears(model) == 0
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)


def test_leaves_unsupported_dtypes_alone() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(8, 8).half())
    assert not can_pack(model)
    assert pack_linears(model) == 0
    assert isinstance(model[0], torch.nn.Linear)


def test_bf16_is_packed_only_where_onednn_runs_it() -> None:
    """On a CPU without oneDNN's bf16 kernels, packing a bf16 weight raises: the model stays
    as it is and still runs."""
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(32, 16).to(torch.bfloat16))
    x = torch.randn(3, 32).to(torch.bfloat16)
    with torch.inference_mode():
        want = model(x)
        supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        assert can_pack(model) is supported
        assert pack_linears(model) == int(supported)
        torch.testing.assert_close(model(x).float(), want.float(), atol=3e-2, rtol=3e-2)


def test_row_padding_bounds_shapes_and_waste() -> None:
    sizes = [padded_rows(m) for m in range(1, 2049)]
    assert sizes[:16] == list(range(1, 17))
    assert all(p >= m and (p - m) / p < 1 / 8 for m, p in zip(range(1, 2049), sizes))
    assert len(set(sizes)) <= 80
    assert sizes == sorted(sizes)


def test_padded_rows_leave_the_output_unchanged() -> None:
    torch.manual_seed(1)
    linear = torch.nn.Linear(32, 24)
    packed = PackedLinear(linear, batch_hint=16)
    with torch.inference_mode():
        for m in (17, 33, 100, 257):
            assert padded_rows(m) != m
            x = torch.randn(1, m, 32)
            torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
