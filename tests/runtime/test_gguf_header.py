"""GGUF files are checked before any conversion: a file cut anywhere in its metadata or tensor
table, a wrong magic or version, or an unsupported architecture, rope scaling or tensor type is an
InvalidRequestError naming ``model_path``; the conversion cache is keyed by the full content hash,
remembered per file."""
import json
import os
import shutil

import pytest

from sglite.errors import InvalidRequestError
from sglite.runtime import model_loader
from sglite.runtime.gguf_header import checked_identity, read_gguf_header


def _write(path, arch="llama", n=3, extra=None):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32("test.n", n)
    w.add_array("test.words", ["a", "bb", "ccc"])
    w.add_tensor("t", np.arange(n * 2, dtype=np.float32).reshape(2, n))
    if extra is not None:
        extra(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_metadata_and_tensor_table(tmp_path):
    h = read_gguf_header(_write(tmp_path / "m.gguf"))
    assert h.architecture == "llama" and h.metadata["test.n"] == 3 and h.metadata["test.words#len"] == 3
    assert h.tensors == {"t": (0, (3, 2))}


def test_every_cut_inside_the_metadata_is_an_invalid_request(tmp_path):
    src = _write(tmp_path / "m.gguf")
    end = read_gguf_header(src).data_start
    data = src.read_bytes()
    for cut in range(0, end):
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(InvalidRequestError) as e:
            read_gguf_header(bad)
        assert e.value.field == "model_path" and str(bad) in str(e.value)


def test_every_cut_inside_the_tensor_data_names_the_tensor(tmp_path, monkeypatch):
    """A file cut inside its data section (a short download) is refused naming the last tensor and
    the file size, before any conversion; formerly a numpy reshape error from inside the converter."""
    src = _write(tmp_path / "m.gguf", n=40)
    data = src.read_bytes()
    assert len(data) - read_gguf_header(src).data_start >= 160  # the 2 x 40 F32 tensor's bytes follow
    monkeypatch.setattr(model_loader, "_convert_gguf", lambda *a: pytest.fail("converted a broken file"))
    for cut in (len(data) - 1, len(data) - 4, len(data) - 100):
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(InvalidRequestError, match=rf"tensor 't' \(F32, shape \[40, 2\]\) ends at byte "
                                                      rf"{len(data)}, past the end of the file \({cut} bytes\)") as e:
            model_loader.load_checkpoint(str(bad), cache_dir=str(tmp_path / "cache"))
        assert e.value.field == "model_path"


@pytest.mark.parametrize("data", [b"GGML" + bytes(40), b"GGUF" + (9).to_bytes(4, "little") + bytes(40),
                                  b"GGUF" + (3).to_bytes(4, "little") + (2**40).to_bytes(8, "little") + bytes(16)])
def test_wrong_magic_version_or_count(tmp_path, data):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data)
    with pytest.raises(InvalidRequestError, match="not a valid GGUF file"):
        read_gguf_header(bad)


def test_truncated_model_file_is_refused_before_conversion(tmp_path, monkeypatch):
    src = _write(tmp_path / "m.gguf")
    data = src.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:40])
    monkeypatch.setattr(model_loader, "_convert_gguf", lambda *a: pytest.fail("converted a broken file"))
    with pytest.raises(InvalidRequestError) as e:
        model_loader.load_checkpoint(str(bad), cache_dir=str(tmp_path / "cache"))
    assert e.value.field == "model_path"


def test_unsupported_architecture_is_refused_before_conversion(tmp_path, monkeypatch):
    import hashlib
    import time

    src = _write(tmp_path / "g.gguf", arch="mamba")
    monkeypatch.setattr(model_loader, "_convert_gguf", lambda *a: pytest.fail("converted an unsupported file"))
    monkeypatch.setattr(hashlib, "sha256", lambda *a: pytest.fail("hashed an unsupported file"))
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match="general.architecture='mamba'.*supported") as e:
        model_loader.load_checkpoint(str(src), cache_dir=str(tmp_path / "cache"))
    assert e.value.field == "model_path" and time.perf_counter() - t0 < 1.0


def _rope_linear(w):
    w.add_string("llama.rope.scaling.type", "linear")


def _rope_freqs(w):
    import numpy as np

    w.add_tensor("rope_freqs.weight", np.ones(4, dtype=np.float32))


def _iq4_nl(w):
    import gguf
    import numpy as np

    w.add_tensor("blk.0.attn_q.weight", np.zeros((2, 18), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)


@pytest.mark.parametrize("extra, arch, names", [
    (_rope_linear, "llama", r"llama.rope.scaling.type='linear'.*supported: \['none'\]"),
    (_rope_freqs, "qwen2", r"rope_freqs.weight.*general.architecture='qwen2'.*supported with it: \['llama'\]"),
    (_iq4_nl, "llama", r"type \['IQ4_NL'\].*supported tensor types: \['F32'.*'Q6_K'\]"),
])
def test_unsupported_rope_or_tensor_type_is_refused_fast_before_hashing_or_conversion(tmp_path, monkeypatch,
                                                                                     extra, arch, names):
    """A rope scaling or tensor type the conversion would drop or cannot read is refused from the
    header alone: the file is neither hashed nor converted, the message names field and choices."""
    import hashlib
    import time

    src = _write(tmp_path / "m.gguf", arch=arch, extra=extra)
    monkeypatch.setattr(model_loader, "_convert_gguf", lambda *a: pytest.fail("converted an unsupported file"))
    monkeypatch.setattr(hashlib, "sha256", lambda *a: pytest.fail("hashed an unsupported file"))
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=names) as e:
        model_loader.load_checkpoint(str(src), cache_dir=str(tmp_path / "cache"))
    assert e.value.field == "model_path" and time.perf_counter() - t0 < 1.0


def test_facts_remembered_and_rechecked(tmp_path):
    """The header facts are remembered with the hash; a remembered file is still checked."""
    from sglite.runtime.gguf_header import checked_facts

    src = _write(tmp_path / "m.gguf", extra=_rope_linear)
    facts = checked_facts(src, tmp_path)
    assert facts["rope_scaling"] == "linear" and facts["tensor_types"] == ["F32"] and not facts["rope_freqs"]
    with pytest.raises(InvalidRequestError, match="rope.scaling.type"):
        model_loader.load_checkpoint(str(src), cache_dir=str(tmp_path))


def test_identity_is_the_full_content_and_remembered(tmp_path):
    src = _write(tmp_path / "m.gguf", n=600_000)  # 4.8 MB: a change in the middle of the tensor data
    digest, arch = checked_identity(src, tmp_path)
    assert arch == "llama"
    index = json.loads((tmp_path / "gguf-hashes.json").read_text())
    assert index[str(src.resolve())]["sha256"] == digest
    # an unchanged file (same size and mtime) is answered from the index: prove it by a planted value
    index[str(src.resolve())]["sha256"] = "planted"
    (tmp_path / "gguf-hashes.json").write_text(json.dumps(index))
    assert checked_identity(src, tmp_path)[0] == "planted"
    # one byte of tensor data changed in the middle, size kept: a new hash (the old key hashed the
    # first and last MiB only)
    data = bytearray(src.read_bytes())
    data[len(data) // 2] ^= 0xFF
    st = src.stat()
    src.write_bytes(bytes(data))
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert checked_identity(src, tmp_path)[0] not in ("planted", digest)


def test_copy_elsewhere_shares_the_key(tmp_path):
    src = _write(tmp_path / "m.gguf")
    other = tmp_path / "x" / "m.gguf"
    other.parent.mkdir()
    shutil.copyfile(src, other)
    assert checked_identity(src, tmp_path)[0] == checked_identity(other, tmp_path)[0]
