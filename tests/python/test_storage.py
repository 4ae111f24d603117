"""Typed and untyped storage on tpu (issue 2/6, class 7) behave as on CUDA: size, data_ptr, copy,
resize, sharing between views, tolist of a copy, pickling and the legacy torch.save format (which
wrap the storage's address in a storage PyTorch does not own). A storage slice, which points
into the middle of a device array, is refused with a RuntimeError, never read."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

import torch_tpu  # noqa: F401  (registers the device)

pytestmark = pytest.mark.mode_dependent


def test_untyped_storage_basics():
    t = torch.arange(6.0, device="tpu")
    s = t.untyped_storage()
    assert s.device == t.device and s.size() == s.nbytes() == 24
    assert s.data_ptr() == t.data_ptr() == t[2:].untyped_storage().data_ptr()  # views share it
    assert s.cpu().tolist() == torch.arange(6.0).untyped_storage().tolist()
    s[0] = 1  # one byte
    assert t.cpu()[0].item() == torch.tensor([1], dtype=torch.int32).view(torch.float32).item()
    other = torch.UntypedStorage(24, device="tpu").copy_(s)
    assert other.cpu().tolist() == s.cpu().tolist() and other.data_ptr() != s.data_ptr()
    assert torch.UntypedStorage(8, device="tpu").fill_(3).cpu().tolist() == [3] * 8
    grown = torch.UntypedStorage(8, device="tpu").fill_(5)
    grown.resize_(16)
    assert grown.size() == 16 and grown.cpu().tolist()[:8] == [5] * 8


def test_typed_storage():
    t = torch.arange(6.0, device="tpu")
    ts = t.storage()
    assert ts.size() == 6 and ts.dtype == torch.float32 and ts.device == t.device
    ts[1] = 9.0
    assert t.cpu().tolist() == [0.0, 9.0, 2.0, 3.0, 4.0, 5.0]
    assert ts.tolist() == t.cpu().tolist() and ts.double().tolist() == t.cpu().tolist()
    assert torch.TypedStorage([1.0, 2.0], dtype=torch.float32, device="tpu").tolist() == [1.0, 2.0]
    u = torch.empty(0, device="tpu").set_(t.untyped_storage(), 2, (2,), (1,))
    assert u.cpu().tolist() == [2.0, 3.0]


def test_pickle_and_the_legacy_save_format():
    t = torch.arange(6.0, device="tpu")
    back = pickle.loads(pickle.dumps(t.storage()))
    assert back.device == t.device and back.tolist() == t.cpu().tolist()
    buf = io.BytesIO()
    torch.save(t, buf, _use_new_zipfile_serialization=False)
    buf.seek(0)
    got = torch.load(buf)
    assert got.device == t.device and got.cpu().tolist() == t.cpu().tolist()


def test_a_storage_slice_is_refused_not_read():
    s = torch.arange(6.0, device="tpu").untyped_storage()
    with pytest.raises(RuntimeError, match="storage slice"):
        s[4:12].cpu()
