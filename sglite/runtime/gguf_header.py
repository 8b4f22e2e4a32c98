"""A GGUF file's header, metadata and tensor table, read and checked before any conversion.

The GGUF layout (ggml's ``docs/gguf.md``, version 2 and 3): magic ``GGUF``, ``uint32`` version,
``uint64`` tensor count, ``uint64`` metadata count; then the metadata key/value pairs (a key is a
``uint64``-length-prefixed UTF-8 string, a value a ``uint32`` type tag and its payload, arrays a
``uint32`` element type, a ``uint64`` count and the elements); then one entry per tensor (name,
``uint32`` rank, ``uint64`` dims, ``uint32`` ggml type, ``uint64`` data offset). Everything is
little-endian.

:func:`read_gguf_header` walks all of it with bounds checks against the file size, so a file cut
anywhere in its metadata, tensor table or tensor data, or with an absurd count, is an ``InvalidRequestError``
naming ``model_path``, not a ``struct.error`` deep inside a converter. Array payloads of fixed-size
types are skipped, not read; string arrays (the tokenizer's vocabulary) are walked.

:func:`checked_identity` is the file's full SHA-256 and architecture, computed once and remembered
beside the cache with the file's size and mtime, so an edited file is never served from an old
file's conversion and an unchanged file is not re-hashed or re-parsed at every start.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InvalidRequestError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
#: type tag -> struct format of a fixed-size GGUF metadata value
_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
#: sanity bounds (far above any real file) so a corrupt count fails fast instead of looping
MAX_COUNT = 1 << 24
MAX_DIMS = 8
#: ggml tensor type id -> name (ggml's ``enum ggml_type``), for the ids a checkpoint may hold
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
                   17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
                   23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16",
                   34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
_FACTS_VERSION = 2  # bump when the facts remembered per file change


@dataclass
class GGUFHeader:
    """What :func:`read_gguf_header` found.

    Attributes:
        version: the GGUF version (2 or 3).
        metadata: scalar and string metadata by key (arrays are left out, except their length under
            ``"<key>#len"``).
        tensors: ``name -> (ggml type id, shape)`` (shape in GGUF order, innermost first).
        data_start: byte offset where tensor data may begin (end of the tensor table).
        offsets: ``name -> data offset`` (bytes, relative to the aligned start of the data section).
    """

    version: int
    metadata: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)
    data_start: int = 0
    offsets: dict = field(default_factory=dict)

    @property
    def architecture(self) -> str | None:
        return self.metadata.get("general.architecture")

    @property
    def data_base(self) -> int:
        """Byte offset of the data section: ``data_start`` rounded up to ``general.alignment`` (32
        by default); a tensor's data starts at ``data_base + offsets[name]``."""
        align = int(self.metadata.get("general.alignment") or 32)
        return (self.data_start + align - 1) // align * align

    def facts(self) -> dict:
        """What the loader checks before any conversion: ``architecture``, ``rope_scaling``
        (``<arch>.rope.scaling.type``, None when absent), ``tensor_types`` (sorted ggml type names,
        ``"type N"`` for an unknown id) and ``rope_freqs`` (whether the file holds a
        ``rope_freqs.weight`` tensor: per-frequency RoPE factors, e.g. Llama 3.1's scaling)."""
        arch = self.architecture
        types = sorted({GGML_TYPE_NAMES.get(t, f"type {t}") for t, _ in self.tensors.values()})
        return {"architecture": arch, "rope_scaling": self.metadata.get(f"{arch}.rope.scaling.type"),
                "tensor_types": types, "rope_freqs": "rope_freqs.weight" in self.tensors}


class _Reader:
    def __init__(self, f, size: int, source: str):
        self.f, self.size, self.source = f, size, source

    def bad(self, what: str) -> InvalidRequestError:
        return InvalidRequestError(f"model_path: {self.source!r} is not a valid GGUF file: {what}",
                                   field="model_path")

    def take(self, n: int) -> bytes:
        if n < 0 or self.f.tell() + n > self.size:
            raise self.bad(f"cut short at byte {self.f.tell()} (needs {n} more bytes; the file has {self.size})")
        return self.f.read(n)

    def skip(self, n: int) -> None:
        if n < 0 or self.f.tell() + n > self.size:
            raise self.bad(f"cut short at byte {self.f.tell()} (needs {n} more bytes; the file has {self.size})")
        self.f.seek(n, os.SEEK_CUR)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def count(self, what: str) -> int:
        n = self.unpack("<Q")
        if n > MAX_COUNT:
            raise self.bad(f"{what} count {n} exceeds {MAX_COUNT}")
        return n

    def string(self) -> str:
        n = self.unpack("<Q")
        raw = self.take(n)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.bad(f"a string at byte {self.f.tell() - n} is not UTF-8") from None

    def value(self, tag: int):
        if tag in _FIXED:
            return self.unpack(_FIXED[tag])
        if tag == _STRING:
            return self.string()
        raise self.bad(f"unknown metadata value type {tag}")

    def skip_strings(self, n: int) -> None:
        """Skip ``n`` length-prefixed strings, walking the lengths in 1 MiB reads (a 262 144-piece
        vocabulary in a fraction of a second, not one file call per string)."""
        pos = self.f.tell()
        base, buf = pos, b""
        for _ in range(n):
            if pos + 8 > base + len(buf):
                self.f.seek(pos)
                base, buf = pos, self.f.read(min(1 << 20, self.size - pos))
                if len(buf) < 8:
                    raise self.bad(f"cut short at byte {pos} (needs 8 more bytes; the file has {self.size})")
            length = struct.unpack_from("<Q", buf, pos - base)[0]
            pos += 8
            if length > self.size - pos:
                raise self.bad(f"cut short at byte {pos} (needs {length} more bytes; the file has {self.size})")
            pos += length
        self.f.seek(pos)

    def skip_array(self) -> int:
        tag, n = self.unpack("<I"), self.count("array element")
        if tag in _FIXED:
            self.skip(n * struct.calcsize(_FIXED[tag]))
        elif tag == _STRING:
            self.skip_strings(n)
        elif tag == _ARRAY:
            for _ in range(n):
                self.skip_array()
        else:
            raise self.bad(f"unknown array element type {tag}")
        return n


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Read and check the header, metadata and tensor table of the GGUF file ``path``.

    Raises:
        InvalidRequestError (field ``model_path``): not a GGUF file, an unsupported version, a file
            cut anywhere before the end of its tensor table, an unknown value type, a count beyond
            :data:`MAX_COUNT`, or a tensor whose data starts or ends past the end of the file.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size, str(path))
        if size < 24 or f.read(4) != MAGIC:
            raise r.bad("no GGUF magic at its start")
        version = r.unpack("<I")
        if version not in VERSIONS:
            raise r.bad(f"version {version} (supported: {list(VERSIONS)})")
        n_tensors, n_kv = r.count("tensor"), r.count("metadata")
        head = GGUFHeader(version=version)
        for _ in range(n_kv):
            key, tag = r.string(), r.unpack("<I")
            if tag == _ARRAY:
                head.metadata[f"{key}#len"] = r.skip_array()
            else:
                head.metadata[key] = r.value(tag)
        for _ in range(n_tensors):
            name, rank = r.string(), r.unpack("<I")
            if rank > MAX_DIMS:
                raise r.bad(f"tensor {name!r} has rank {rank}")
            shape = tuple(r.unpack("<Q") for _ in range(rank))
            ggml_type, offset = r.unpack("<I"), r.unpack("<Q")
            head.tensors[name] = (ggml_type, shape)
            head.offsets[name] = offset
            if offset > size:
                raise r.bad(f"tensor {name!r} starts past the end of the file")
        head.data_start = f.tell()
    _check_tensor_extents(head, r, size)
    return head


def _check_tensor_extents(head: GGUFHeader, r: "_Reader", size: int) -> None:
    """Refuse a file whose tensor data ends past its last byte (a download or copy cut inside the
    data section): each tensor of a known ggml type needs ``elements / block * type_size`` bytes
    from the aligned data start + its offset (gguf-py's ``GGML_QUANT_SIZES``)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    base = head.data_base
    for name, (ggml_type, shape) in head.tensors.items():
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            continue  # unknown type id: refused by name in the type check
        n = 1
        for d in shape:
            n *= int(d)
        end = base + head.offsets[name] + n // block * type_size
        if end > size:
            raise r.bad(f"tensor {name!r} ({GGML_TYPE_NAMES.get(ggml_type, ggml_type)}, shape {list(shape)}) "
                        f"ends at byte {end}, past the end of the file ({size} bytes): the file is cut short")


def read_rope_freqs(path: str | os.PathLike) -> list[float] | None:
    """The ``rope_freqs.weight`` tensor of the GGUF file ``path`` (llama.cpp's per-frequency RoPE
    divisors: frequency ``i`` of a head is ``theta ** (-2i / D) / rope_freqs[i]``; Llama 3.1's
    scaling, written by llama.cpp's converter from the config's ``rope_scaling``), as D/2 floats,
    or None when the file has no such tensor.

    Raises:
        InvalidRequestError (field ``model_path``): the tensor is not 1-D F32/F16, or its data lies
            past the end of the file.
    """
    head = read_gguf_header(path)
    if "rope_freqs.weight" not in head.tensors:
        return None
    ggml_type, shape = head.tensors["rope_freqs.weight"]
    fmt = {0: ("<f", 4), 1: ("<e", 2)}.get(ggml_type)
    if fmt is None or len(shape) != 1:
        raise InvalidRequestError(
            f"model_path: {str(path)!r} has a rope_freqs.weight tensor of type "
            f"{GGML_TYPE_NAMES.get(ggml_type, ggml_type)} and shape {list(shape)}; supported: 1-D F32 or F16",
            field="model_path")
    start = head.data_base + head.offsets["rope_freqs.weight"]
    n, (code, width) = int(shape[0]), fmt
    with open(path, "rb") as f:
        f.seek(start)
        raw = f.read(n * width)
    if len(raw) != n * width:
        raise InvalidRequestError(f"model_path: {str(path)!r} is cut short inside its rope_freqs.weight tensor",
                                  field="model_path")
    return [float(x) for x in struct.unpack(f"<{n}{code[1]}", raw)]


def checked_identity(path: str | os.PathLike, index_dir: str | os.PathLike) -> tuple[str, str | None]:
    """``(sha256 hex of the whole file, general.architecture)`` of the GGUF file ``path`` (see
    :func:`checked_facts`)."""
    facts = checked_facts(path, index_dir)
    return facts["sha256"], facts["architecture"]


def checked_facts(path: str | os.PathLike, index_dir: str | os.PathLike,
                  check: Callable[[dict], None] | None = None) -> dict:
    """The GGUF file ``path`` checked with :func:`read_gguf_header`: its :meth:`GGUFHeader.facts`
    plus ``sha256`` (hex digest of the whole file). ``check(facts)`` (which raises to refuse the
    file) runs on the facts before the file is hashed, and on remembered facts too.

    They are computed once and remembered in ``index_dir/gguf-hashes.json`` under the file's
    resolved path with its size and ``st_mtime_ns``: a later call for an unchanged file reads the
    index instead of the file (a start does not re-hash or re-parse it). The index is rewritten
    atomically; a missing or corrupt index is rebuilt; a read-only one only costs the recomputation.

    Raises:
        InvalidRequestError (field ``model_path``): the file is not a valid GGUF file.
    """
    path = Path(path).resolve()
    st = path.stat()
    index_path = Path(index_dir) / "gguf-hashes.json"
    try:
        index = json.loads(index_path.read_text())
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path))
    if (isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns
            and isinstance(entry.get("sha256"), str) and entry.get("facts_version") == _FACTS_VERSION):
        if check is not None:
            check(entry)
        return entry
    facts = read_gguf_header(path).facts()
    if check is not None:
        check(facts)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    entry = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest, "facts_version": _FACTS_VERSION,
             **facts}
    index[str(path)] = entry
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gguf-hashes.", dir=index_path.parent)
        with os.fdopen(fd, "w") as out:
            json.dump(index, out)
        os.replace(tmp, index_path)
    except OSError:
        pass
    return entry
