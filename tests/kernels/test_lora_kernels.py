"""Segmented LoRA op (sglite.kernels.lora_add): the torch reference against per-row PEFT-style
math, the C++ CPU kernel against the reference on random shapes and segmentations, dispatcher
routing, and the C++ kernel's input errors."""
import pytest
import torch

from tests.kernels.builds import built
from sglite import kernels
from sglite.kernels import cpu_lora, reference


def random_case(N, K, O, R, S, G, dtype, seed, wdtype=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g).to(dtype)
    y = torch.randn(N, O, generator=g).to(dtype)
    a = (torch.randn(S, R, K, generator=g) / K ** 0.5).to(wdtype or dtype)  # wdtype: --lora-dtype
    b = torch.randn(S, R, O, generator=g).to(wdtype or dtype)
    cuts = sorted(torch.randint(0, N + 1, (G - 1,), generator=g).tolist())
    lens = torch.tensor([e - s for s, e in zip([0] + cuts, cuts + [N])], dtype=torch.int64)
    slots = torch.randint(-1, S, (G,), generator=g, dtype=torch.int64)
    return y, x, a, b, lens, slots


def per_row(y, x, a, b, lens, slots):
    out = y.clone().double()
    rows = torch.repeat_interleave(slots, lens)
    for i, s in enumerate(rows.tolist()):
        if s >= 0:
            out[i] += (x[i].double() @ a[s].double().t()) @ b[s].double()
    return out


@pytest.mark.parametrize("N,K,O,R,S,G", [(1, 16, 8, 4, 1, 1), (7, 64, 96, 8, 3, 4), (33, 40, 17, 16, 4, 6)])
def test_reference_is_per_row_lora(N, K, O, R, S, G):
    y, x, a, b, lens, slots = random_case(N, K, O, R, S, G, torch.float32, N + K)
    want = per_row(y, x, a, b, lens, slots)
    untouched = torch.repeat_interleave(slots, lens) < 0
    got = reference.lora_add(y.clone(), x, a, b, lens, slots)
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[untouched], y[untouched])  # rows without an adapter pay nothing


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("N,K,O,R,S,G", [(1, 576, 960, 48, 2, 1), (9, 64, 128, 16, 3, 5), (40, 37, 23, 5, 5, 9),
                                         (5, 128, 64, 8, 1, 5), (70, 96, 600, 16, 3, 3)])
def test_cpp_matches_reference(N, K, O, R, S, G, dtype, wdtype):
    built(cpu_lora.load)
    y, x, a, b, lens, slots = random_case(N, K, O, R, S, G, dtype, 7 * N + R, wdtype)
    ref = reference.lora_add(y.clone(), x, a, b, lens, slots)
    out = y.clone()
    got = cpu_lora.lora_add(out, x, a, b, lens, slots)
    assert got.data_ptr() == out.data_ptr()  # in place
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    else:
        torch.testing.assert_close(got.float(), ref.float(), atol=5e-2, rtol=2e-2)
    untouched = torch.repeat_interleave(slots, lens) < 0
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("N,K,O,R,S,G", [(3, 48, 80, 16, 2, 2), (17, 96, 40, 8, 4, 5)])
def test_bf16_weights_under_float32_activations(N, K, O, R, S, G):
    """``--lora-dtype bfloat16`` on a float32 model: reference and C++ equal the float64 per-row math
    on the bf16-rounded weights (they are read exactly, summed in float32)."""
    built(cpu_lora.load)
    y, x, a, b, lens, slots = random_case(N, K, O, R, S, G, torch.float32, 11 * N + K, torch.bfloat16)
    want = per_row(y, x, a, b, lens, slots)
    ref = reference.lora_add(y.clone(), x, a, b, lens, slots)
    got = kernels.lora_add(y.clone(), x, a, b, lens, slots)
    assert ref.dtype == got.dtype == torch.float32
    torch.testing.assert_close(ref.double(), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(RuntimeError, match="a and b another"):
        cpu_lora.load().lora_add(y.clone(), x, a, b.float(), lens, slots)


@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_cpp_tiles_do_not_change_values(dtype, wdtype):
    """Rows of one segment share each A / b load (tiles of 16 rows, 64-column expand chunks): every
    row equals the same row run alone (a segment of one row), bitwise, long segments and O > 256."""
    ops = built(cpu_lora.load)
    y, x, a, b, lens, slots = random_case(45, 80, 530, 16, 3, 3, dtype, 5, wdtype)
    lens, slots = torch.tensor([20, 1, 24]), torch.tensor([0, 2, 1])  # segments across whole tiles and a remainder
    got = ops.lora_add(y.clone(), x, a, b, lens, slots)
    rows = torch.repeat_interleave(slots, lens)
    one = ops.lora_add(y.clone(), x, a, b, torch.ones(45, dtype=torch.int64), rows)
    assert torch.equal(got, one)
    ref = reference.lora_add(y.clone(), x, a, b, lens, slots)
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-4 if dtype == torch.float32 else 5e-2,
                               rtol=1e-4 if dtype == torch.float32 else 2e-2)


def test_cpp_strided_rows_and_dispatch():
    built(cpu_lora.load)
    y, x, a, b, lens, slots = random_case(6, 32, 24, 4, 2, 3, torch.float32, 3)
    xs = torch.cat([x, torch.zeros(6, 5)], 1)[:, :32]  # strided rows
    ref = reference.lora_add(y.clone(), x, a, b, lens, slots)
    torch.testing.assert_close(kernels.lora_add(y.clone(), xs, a, b, lens, slots), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(kernels.lora_add(y.clone(), x, a, b, lens, slots, impl="torch"), ref)
    with pytest.raises(ValueError, match="unknown kernel implementation"):
        kernels.lora_add(y.clone(), x, a, b, lens, slots, impl="nope")


def test_cpp_input_errors():
    ops = built(cpu_lora.load)
    y, x, a, b, lens, slots = random_case(4, 16, 8, 4, 2, 2, torch.float32, 1)
    with pytest.raises(RuntimeError, match="seg_lens sum"):
        ops.lora_add(y, x, a, b, lens + 1, slots)
    with pytest.raises(IndexError, match="seg_slots"):
        ops.lora_add(y, x, a, b, lens, torch.tensor([5, 0]))
    with pytest.raises(RuntimeError, match="shapes disagree"):
        ops.lora_add(y, x, a, b[:, :, :4], lens, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_spans_skip_zero_blocks(dtype):
    """Stacked rank blocks (as q / k / v in one fused matmul): with ``spans`` the kernel skips the
    zero rank rows and columns and gives the same bits as without; spans outside the buffers are
    refused."""
    ops = built(cpu_lora.load)
    y, x, a, b, lens, slots = random_case(30, 64, 300, 12, 2, 4, dtype, 9)
    spans = torch.tensor([[[4, 0, 100], [2, 100, 140], [3, 140, 300]],
                          [[1, 0, 100], [0, 0, 0], [4, 180, 300]]], dtype=torch.int64)
    for s in range(2):  # zero what the spans say is unused
        for j in range(3):
            r, lo, hi = spans[s, j].tolist()
            a[s, 4 * j + r:4 * j + 4] = 0
            b[s, 4 * j:4 * j + 4] = 0
            b[s, 4 * j:4 * j + r, lo:hi] = torch.randn(r, hi - lo).to(dtype)
    want = ops.lora_add(y.clone(), x, a, b, lens, slots)
    got = kernels.lora_add(y.clone(), x, a, b, lens, slots, spans=spans)
    assert torch.equal(got, want)
    ref = reference.lora_add(y.clone(), x, a, b, lens, slots)
    torch.testing.assert_close(got.float(), ref.float(), atol=1e-4 if dtype == torch.float32 else 5e-2,
                               rtol=1e-4 if dtype == torch.float32 else 2e-2)
    with pytest.raises(RuntimeError, match="spans entry"):
        ops.lora_add(y.clone(), x, a, b, lens, slots, spans + torch.tensor([0, 0, 400]))
    with pytest.raises(RuntimeError, match="blocks dividing R"):
        ops.lora_add(y.clone(), x, a, b, lens, slots, torch.zeros(2, 5, 3, dtype=torch.int64))  # 5 does not divide 12
