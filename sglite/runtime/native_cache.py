"""Start-up cache of a GGUF file's quantized weights: the :class:`~sglite.kernels.QuantLinearWeight`
dict that :func:`sglite.runtime.gguf_native.load_state_dict` builds from the file's blocks, saved
once next to the converted float32 folder and memory-mapped back on later starts.

Why: reading the blocks needs ``gguf.GGUFReader``, which parses every metadata field of the file
first (the default model's 49,152-token vocabulary and 48,900 merges, one small numpy read each):
~4 s of a ~9 s engine start here, for 98 MB of weights that a safetensors file maps in well under
a second.

File: ``<converted folder>/sglite_native.qcache`` (safetensors format; not named ``*.safetensors``
so it is never mistaken for float weights). Per weight ``name``: tensors ``name::qweight``,
``name::scales`` and ``name::mins`` (when present), and its fields (bits, group_size, in_features,
fmt) in the JSON metadata entry ``sglite_quant``, with :data:`VERSION`. Only row-layout weights
without ``perm`` / ``bias`` are stored (what GGUF blocks give). The converted folder is keyed by the
GGUF file's path, size, mtime and content hash (:mod:`sglite.runtime.model_loader`), so a changed
file gets a new folder and a new cache. Written to a temporary name and renamed into place; a file
that does not read back (other version, truncated, another program's) is ignored and rewritten.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

import torch

from sglite.kernels.quant_linear import QuantLinearWeight

log = logging.getLogger(__name__)

FILENAME = "sglite_native.qcache"
VERSION = "2"  # 2: Q5_0 / Q5_1 / Q5_K blocks kept quantized too
_FIELDS = ("bits", "group_size", "in_features", "fmt")


def cache_path(model_dir: Path) -> Path:
    """Where the cache of the converted folder ``model_dir`` lives."""
    return Path(model_dir) / FILENAME


def save(path: Path, weights: dict) -> bool:
    """Write the QuantLinearWeights of ``weights`` (name -> weight; CPU row layout, no perm / bias)
    to ``path``. Returns False (nothing written, a warning logged) when a weight does not qualify
    or the folder is not writable."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, w in weights.items():
        if not isinstance(w, QuantLinearWeight):
            continue
        if w.tiled or w.perm is not None or w.bias is not None:
            log.warning("native cache: %s is not a plain GGUF weight; not caching", name)
            return False
        tensors[f"{name}::qweight"] = w.qweight.cpu().contiguous()
        tensors[f"{name}::scales"] = w.scales.cpu().contiguous()
        if w.mins is not None:
            tensors[f"{name}::mins"] = w.mins.cpu().contiguous()
        meta[name] = {f: getattr(w, f) for f in _FIELDS}
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata={"sglite_quant": json.dumps(meta), "version": VERSION})
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        return True
    except OSError as exc:
        log.warning("native cache: cannot write %s (%s); the next start reads the GGUF file again", path, exc)
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        return False


def load(path: Path, device: str = "cpu") -> Optional[dict]:
    """The weights saved by :func:`save` at ``path`` (name -> QuantLinearWeight on ``device``), or
    None when there is no readable cache of this :data:`VERSION` there."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            if md.get("version") != VERSION:
                return None
            out = {}
            for name, fields in json.loads(md["sglite_quant"]).items():
                mins = f.get_tensor(f"{name}::mins") if f"{name}::mins" in f.keys() else None
                w = QuantLinearWeight(f.get_tensor(f"{name}::qweight"), f.get_tensor(f"{name}::scales"), mins,
                                      int(fields["bits"]), int(fields["group_size"]), int(fields["in_features"]),
                                      fmt=str(fields["fmt"]))
                out[name] = w.to(device)
            return out
    except (SafetensorError, OSError, KeyError, ValueError, json.JSONDecodeError) as exc:
        log.warning("native cache: %s is unreadable (%s); rebuilding it from the GGUF file", path, exc)
        return None
