"""Rewrite a GGUF file with changes (tests of bad models): drop or change tensors, set,
retype or drop keys. Reads with gguf.GGUFReader, writes with gguf.GGUFWriter.

    from gguf_rewrite import rewrite_gguf
    rewrite_gguf(src, dst, drop=["blk.1.ffn_up.weight"])
    rewrite_gguf(src, dst, tensors={"blk.0.attn_k.weight": lambda a: a[:-1]})
    rewrite_gguf(src, dst, kv={"llama.block_count": ("2", gguf.GGUFValueType.STRING)})
"""

from __future__ import annotations

from typing import Callable

import numpy as np


def rewrite_gguf(src, dst, *, drop=(), tensors: dict[str, Callable] | None = None,
                 kv: dict | None = None, drop_kv=(), add: dict | None = None):
    """Copy src to dst. drop: tensor names left out; tensors: name -> f(array) -> array
    applied to that tensor's data (same storage type, or return (data, type) to change
    it); kv: key -> (value, GGUFValueType)
    set (replacing the file's value, whatever its type); drop_kv: keys left out;
    add: name -> array (stored as its numpy dtype: float32 F32, int32 I32, ...) or
    (raw data, GGMLQuantizationType), appended after the file's tensors.
    Returns dst."""
    import gguf

    tensors, kv = tensors or {}, kv or {}
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), bytes(r.fields["general.architecture"].parts[-1]).decode())
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture" or f.name in drop_kv:
            continue
        if f.name in kv:
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[-1]
            vals = [bytes(f.parts[i]).decode() if sub == gguf.GGUFValueType.STRING
                    else f.parts[i].tolist()[0] for i in f.data]
            w.add_array(f.name, vals)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_string(f.name, bytes(f.parts[f.data[0]]).decode())
        else:
            w.add_key_value(f.name, f.parts[f.data[0]].tolist()[0], vtype)
    for key, (value, vtype) in kv.items():
        w.add_key_value(key, value, vtype)
    for t in r.tensors:
        if t.name in drop:
            continue
        arr, dtype = np.array(t.data), t.tensor_type
        if t.name in tensors:
            arr = tensors[t.name](arr)
            if isinstance(arr, tuple):  # (raw data, GGMLQuantizationType): a new storage type
                arr, dtype = arr
        w.add_tensor(t.name, arr, raw_dtype=dtype)
    for name, arr in (add or {}).items():
        if isinstance(arr, tuple):
            w.add_tensor(name, arr[0], raw_dtype=arr[1])
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst
