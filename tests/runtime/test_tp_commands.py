"""Tensor-parallel control messages (:mod:`sglite.runtime.parallel.commands`): typed records that
round-trip exactly through their wire format, and bytes that are not a valid record (a pickle
included) are refused with ValueError, never unpickled."""
import json
import pickle

import pytest
import torch

from sglite.runtime.parallel.tp_worker import compact_batch
from sglite.runtime.forward_batch import ForwardBatch
from sglite.runtime.parallel.commands import MESSAGES, Forward, StepDone, Stop, decode, encode


def _batch() -> ForwardBatch:
    """A mixed step on a 16-row slot table: one extend request (row 5, 3 tokens after 2 cached)
    and two decode rows (rows 2 and 9)."""
    table = torch.arange(16 * 40, dtype=torch.int32).reshape(16, 40)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return ForwardBatch(input_ids=t([7, 8, 9, 10, 11]), positions=t([2, 3, 4, 6, 11]),
                        out_cache_loc=t([202, 203, 204, 86, 371]), req_to_token=table,
                        ext_req_pool_indices=t([5]), ext_prefix_lens=t([2]), ext_extend_lens=t([3]),
                        dec_req_pool_indices=t([2, 9]), dec_seq_lens=t([7, 12]), logits_indices=t([2, 3, 4]))


def test_forward_round_trips_field_for_field():
    fb = compact_batch(_batch())
    assert fb.req_to_token.shape == (3, 12)  # rows 2, 5, 9; longest sequence 12
    got = decode(encode(Forward(fb)))
    assert isinstance(got, Forward)
    for name, want in fb.__dict__.items():
        have = getattr(got.batch, name)
        assert have.dtype == want.dtype and have.shape == want.shape and torch.equal(have, want), name


def test_compact_batch_keeps_each_rows_slots():
    fb = _batch()
    c = compact_batch(fb)
    for old, new in zip(fb.ext_req_pool_indices.tolist() + fb.dec_req_pool_indices.tolist(),
                        c.ext_req_pool_indices.tolist() + c.dec_req_pool_indices.tolist()):
        assert torch.equal(c.req_to_token[new], fb.req_to_token[old, :c.req_to_token.shape[1]])


@pytest.mark.parametrize("msg", [Stop(), StepDone(), StepDone("RuntimeError: out of memory")])
def test_small_messages_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_the_wire_is_a_json_header_and_raw_bytes():
    buf = encode(Forward(compact_batch(_batch())))
    n = int(buf[:8].clone().view(torch.int64))
    header = json.loads(buf[8:8 + n].numpy().tobytes())
    assert header["type"] == "forward" and header["fields"] == {}
    names = [row[0] for row in header["tensors"]]
    assert sorted(names) == sorted(ForwardBatch.__dataclass_fields__)
    assert all(row[3] % 8 == 0 for row in header["tensors"])  # aligned offsets
    assert set(MESSAGES) == {"forward", "stop", "step_done", "load_lora", "unload_lora"}


def _with_header(header: dict, payload: bytes = b"") -> torch.Tensor:
    h = json.dumps(header).encode()
    raw = len(h).to_bytes(8, "little") + h + payload
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@pytest.mark.parametrize("buf, match", [
    (torch.frombuffer(bytearray(pickle.dumps(("stop",))), dtype=torch.uint8), "header length"),
    (torch.zeros(4, dtype=torch.uint8), "at least 8 bytes"),
    (_with_header({"type": "exec", "fields": {}, "tensors": []}), "bad header"),
    (_with_header({"type": "forward", "fields": {}, "tensors": [["input_ids", "object", [1], 0, 8]]}, bytes(8)),
     "unknown dtype"),
    (_with_header({"type": "forward", "fields": {}, "tensors": [["input_ids", "int64", [4], 0, 32]]}, bytes(8)),
     "outside the payload"),
    (_with_header({"type": "forward", "fields": {}, "tensors": [["input_ids", "int64", [3], 0, 8]]}, bytes(8)),
     "input_ids"),
    (_with_header({"type": "forward", "fields": {}, "tensors": []}), "expected"),
    (_with_header({"type": "step_done", "fields": {"error": 3}, "tensors": []}), "error must be"),
])
def test_malformed_bytes_are_refused(buf, match):
    with pytest.raises(ValueError, match=match):
        decode(buf)


def test_only_known_messages_and_dtypes_encode():
    with pytest.raises(TypeError, match="not a control-channel message"):
        encode(("forward", {}))
    fb = compact_batch(_batch())
    bad = ForwardBatch(**{**fb.__dict__, "input_ids": fb.input_ids.to(torch.complex64)})
    with pytest.raises(TypeError, match="cannot travel"):
        encode(Forward(bad))


def test_lora_commands_round_trip():
    from sglite.runtime.parallel.commands import LoadLora, UnloadLora

    fb = _batch()
    fb.lora_segments = [[3, None], [2, object()]]  # instance attributes: compact_batch leaves them out
    lens, uids = torch.tensor([3, 2]), torch.tensor([0, 7])
    got = decode(encode(Forward(compact_batch(fb), lens, uids)))
    assert torch.equal(got.lora_lens, lens) and torch.equal(got.lora_uids, uids)
    assert got.batch.lora_segments is None and decode(encode(Forward(compact_batch(fb)))).lora_lens is None
    assert decode(encode(LoadLora("a", "/x/a", 3))) == LoadLora("a", "/x/a", 3)
    assert decode(encode(UnloadLora("a"))) == UnloadLora("a")
    with pytest.raises(ValueError, match="lora_lens and lora_uids"):
        decode(encode(Forward(compact_batch(fb), lens, uids.int())))
    with pytest.raises(ValueError, match="uid an integer"):
        LoadLora.from_wire({"name": "a", "path": "/x", "uid": "3"}, {})
