"""The native GGUF reader: valid files written by gguf.GGUFWriter read back exactly (checked
against gguf.GGUFReader), and malformed files give a NativeError with a specific message,
never a crash.

Set GH_GGUF_DUMP_DIR to a folder to also write every image these tests parse there (a
seed corpus for tools/fuzz/gguf_fuzz.c)."""

from __future__ import annotations

import hashlib
import os
import random
import struct
from pathlib import Path

import cffi
import gguf
import numpy as np
import pytest

from powerinfer_cpp._native import NativeError, check, ffi, lib, lib_path
from conftest import TESTS_DIR  # noqa: E402

VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
INT_TYPES = {VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64}
REGRESSIONS = TESTS_DIR / "data" / "gguf_regressions"


def _dump(image: bytes) -> None:
    d = os.environ.get("GH_GGUF_DUMP_DIR")
    if d:
        Path(d).mkdir(parents=True, exist_ok=True)
        (Path(d) / hashlib.sha1(image).hexdigest()).write_bytes(image)


# ---- a thin reader over the C API ----

class Gguf:
    """An open native handle; the image buffer (memory opens) is kept alive with it."""

    def __init__(self, handle, buf=None):
        self.h = handle
        self.buf = buf

    def close(self):
        if self.h is not None:
            lib.gh_gguf_close(self.h)
            self.h = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def n_kv(self) -> int:
        return lib.gh_gguf_n_kv(self.h)

    @property
    def n_tensors(self) -> int:
        return lib.gh_gguf_n_tensors(self.h)

    def value(self, i: int):
        t = lib.gh_gguf_kv_type(self.h, i)
        if t in INT_TYPES:
            out = ffi.new("int64_t *")
            check(lib.gh_gguf_kv_int(self.h, i, out))
            return t, out[0]
        if t == VT.BOOL:
            out = ffi.new("int64_t *")
            check(lib.gh_gguf_kv_int(self.h, i, out))
            return t, bool(out[0])
        if t in (VT.FLOAT32, VT.FLOAT64):
            out = ffi.new("double *")
            check(lib.gh_gguf_kv_float(self.h, i, out))
            return t, out[0]
        if t == VT.STRING:
            return t, ffi.string(lib.gh_gguf_kv_str(self.h, i)).decode("utf-8", "replace")
        assert t == VT.ARRAY
        et = ffi.new("int32_t *")
        n = lib.gh_gguf_kv_arr(self.h, i, et)
        return t, (et[0], n)

    def kvs(self) -> dict:
        out = {}
        for i in range(self.n_kv):
            key = ffi.string(lib.gh_gguf_kv_key(self.h, i)).decode("utf-8")
            assert lib.gh_gguf_find_key(self.h, key.encode()) == i
            out[key] = self.value(i)
        return out

    def tensors(self) -> list[dict]:
        out = []
        typ, nd = ffi.new("int32_t *"), ffi.new("int32_t *")
        ne = ffi.new("int64_t[4]")
        off, nb = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        data = ffi.new("const void **")
        for i in range(self.n_tensors):
            check(lib.gh_gguf_tensor_info(self.h, i, typ, nd, ne, off, nb, data))
            out.append(dict(name=ffi.string(lib.gh_gguf_tensor_name(self.h, i)).decode(),
                            type=typ[0], n_dims=nd[0], ne=list(ne), offset=off[0],
                            nbytes=nb[0], data=data[0]))
        return out


def open_path(path) -> Gguf:
    out = ffi.new("gh_gguf **")
    check(lib.gh_gguf_open(str(path).encode(), out))
    return Gguf(out[0])


def open_mem(image: bytes) -> Gguf:
    _dump(image)
    buf = ffi.from_buffer(image) if image else ffi.NULL
    out = ffi.new("gh_gguf **")
    st = lib.gh_gguf_open_memory(buf, len(image), out)
    if st != 0:
        assert out[0] == ffi.NULL
    check(st)
    return Gguf(out[0], (image, buf))


def expect_error(image: bytes, status: int, *fragments: str) -> str:
    """Open `image` from memory; it must fail with `status` and a message with every fragment."""
    with pytest.raises(NativeError) as ei:
        open_mem(image).close()
    msg = str(ei.value)
    assert ei.value.status == status, msg
    for f in fragments:
        assert f in msg, msg
    return msg


def walk(g: Gguf, image: bytes) -> None:
    """Touch everything a successfully opened handle exposes; tensor data must lie in the image."""
    g.kvs()
    base = int(ffi.cast("uintptr_t", g.buf[1]))
    for t in g.tensors():
        start = int(ffi.cast("uintptr_t", t["data"])) - base
        assert 0 <= start and start + t["nbytes"] <= len(image)
        assert 1 <= t["n_dims"] <= 4


# ---- hand-built images ----

def gstr(s) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv(key, vtype: int, payload: bytes) -> bytes:
    return gstr(key) + struct.pack("<I", vtype) + payload


def kv_u32(key, v: int) -> bytes:
    return kv(key, VT.UINT32, struct.pack("<I", v))


def tinfo(name, ne, typ: int = QT.F32, offset: int = 0) -> bytes:
    return (gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
            + struct.pack("<IQ", typ, offset))


def image(kvs=(), tensors=(), data=b"", version=3, n_kv=None, n_tensors=None, align=32,
          magic=b"GGUF") -> bytes:
    head = magic + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                               len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    body += b"\0" * (-len(body) % align)
    return body + data


# ---- files written by gguf.GGUFWriter ----

def quant_bytes(rng, qtype, rows: int, cols: int) -> np.ndarray:
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    return rng.integers(0, 256, size=(rows, cols // bs * ts), dtype=np.uint8)


def write_file(path: Path, alignment: int | None = None, kvs: bool = True, tensors: bool = True):
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), arch="llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    if kvs:
        w.add_uint8("t.u8", 250)
        w.add_int8("t.i8", -120)
        w.add_uint16("t.u16", 65000)
        w.add_int16("t.i16", -32000)
        w.add_uint32("t.u32", 4_000_000_000)
        w.add_int32("t.i32", -2_000_000_000)
        w.add_uint64("t.u64", 2**63 - 5)
        w.add_int64("t.i64", -(2**62))
        w.add_float32("t.f32", 0.5)
        w.add_float64("t.f64", 1e300)
        w.add_bool("t.true", True)
        w.add_bool("t.false", False)
        w.add_string("t.str", "héllo wörld ✓")
        w.add_key_value("t.empty", "", VT.STRING)  # add_string skips ""
        w.add_array("t.arr.str", ["a", "", "ccc", "ünï"])
        w.add_array("t.arr.i32", [1, -2, 3])
        w.add_array("t.arr.f32", [0.5, 1.5])
        w.add_array("t.arr.bool", [True, False, True])
        for vt in (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.UINT64, VT.INT64,
                   VT.FLOAT64):
            w.add_key_value(f"t.arr.{vt.name.lower()}", [1, 2, 3, 4, 5], VT.ARRAY, sub_type=vt)
    if tensors:
        w.add_tensor("f32.1d", rng.standard_normal(7).astype(np.float32))
        w.add_tensor("f32.4d", rng.standard_normal((2, 3, 1, 5)).astype(np.float32))
        w.add_tensor("f16", rng.standard_normal((3, 10)).astype(np.float16))
        bf = rng.integers(0, 65536, size=(4, 6), dtype=np.uint16).view(np.uint8)
        w.add_tensor("bf16", bf, raw_dtype=QT.BF16)
        w.add_tensor("q8_0", quant_bytes(rng, QT.Q8_0, 3, 64), raw_dtype=QT.Q8_0)
        w.add_tensor("q4_0", quant_bytes(rng, QT.Q4_0, 2, 96), raw_dtype=QT.Q4_0)
        w.add_tensor("blk.0.ffn_up.weight", quant_bytes(rng, QT.Q8_0, 5, 32), raw_dtype=QT.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def expected_from_reader(path: Path):
    r = gguf.GGUFReader(str(path))
    kvs = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        t = f.types[0]
        if t == VT.ARRAY:
            kvs[name] = (t, (f.types[-1], len(f.data)))
        elif t == VT.STRING:
            kvs[name] = (t, f.contents())
        else:
            kvs[name] = (t, f.contents())
    data_start = min((t.data_offset for t in r.tensors), default=None)
    tensors = [dict(name=t.name, type=int(t.tensor_type), ne=[int(x) for x in t.shape],
                    abs_offset=int(t.data_offset), nbytes=int(t.n_bytes)) for t in r.tensors]
    return kvs, tensors, data_start


def check_against_reader(g: Gguf, path: Path):
    kvs, tensors, _ = expected_from_reader(path)
    got = g.kvs()
    assert set(got) == set(kvs)
    for k, (t, v) in kvs.items():
        gt, gv = got[k]
        assert gt == t, k
        if t == VT.FLOAT32:
            assert gv == pytest.approx(float(v), rel=1e-7), k
        elif t == VT.ARRAY:
            assert gv == (int(v[0]), v[1]), k
        else:
            assert gv == v, k
    got_t = g.tensors()
    assert [t["name"] for t in got_t] == [t["name"] for t in tensors]
    raw = path.read_bytes()
    base = int(ffi.cast("uintptr_t", got_t[0]["data"])) - tensors[0]["abs_offset"] if got_t else 0
    for gt, et in zip(got_t, tensors):
        assert gt["type"] == et["type"]
        assert gt["ne"][:gt["n_dims"]] == et["ne"] and all(x == 1 for x in gt["ne"][gt["n_dims"]:])
        assert gt["nbytes"] == et["nbytes"]
        assert int(ffi.cast("uintptr_t", gt["data"])) - base == et["abs_offset"]
        got_bytes = bytes(ffi.buffer(ffi.cast("const char *", gt["data"]), gt["nbytes"]))
        assert got_bytes == raw[et["abs_offset"]:et["abs_offset"] + et["nbytes"]]


@pytest.mark.parametrize("alignment", [None, 1, 8, 64, 4096])
def test_writer_files_read_back(tmp_path, alignment):
    path = tmp_path / "m.gguf"
    write_file(path, alignment)
    with open_path(path) as g:
        assert g.n_tensors == 7
        assert g.n_kv == 27 + (alignment is not None)
        check_against_reader(g, path)
        if alignment:
            assert g.kvs()["general.alignment"] == (VT.UINT32, alignment)
        for t in g.tensors():
            assert t["offset"] % (alignment or 32) == 0
    data = path.read_bytes()
    with open_mem(data) as g:
        assert [t["name"] for t in g.tensors()][:3] == ["f32.1d", "f32.4d", "f16"]
        walk(g, data)


def test_tensor_types_and_shapes(tmp_path):
    path = tmp_path / "m.gguf"
    write_file(path)
    with open_path(path) as g:
        t = {x["name"]: x for x in g.tensors()}
    assert (t["f32.1d"]["type"], t["f32.1d"]["ne"], t["f32.1d"]["nbytes"]) == (0, [7, 1, 1, 1], 28)
    assert t["f32.4d"]["ne"] == [5, 1, 3, 2] and t["f32.4d"]["n_dims"] == 4
    assert (t["f16"]["type"], t["f16"]["ne"][:2], t["f16"]["nbytes"]) == (1, [10, 3], 60)
    assert (t["bf16"]["type"], t["bf16"]["ne"][:2], t["bf16"]["nbytes"]) == (30, [6, 4], 48)
    assert (t["q8_0"]["type"], t["q8_0"]["ne"][:2], t["q8_0"]["nbytes"]) == (8, [64, 3], 3 * 2 * 34)
    assert (t["q4_0"]["type"], t["q4_0"]["ne"][:2], t["q4_0"]["nbytes"]) == (2, [96, 2], 2 * 3 * 18)


def test_metadata_only_and_tensor_only_files(tmp_path):
    for kvs, tensors in ((True, False), (False, True), (False, False)):
        path = tmp_path / f"m{kvs}{tensors}.gguf"
        write_file(path, kvs=kvs, tensors=tensors)
        with open_path(path) as g:
            check_against_reader(g, path)
            assert g.n_tensors == (7 if tensors else 0)


def test_version_2_reads_like_3(tmp_path):
    path = tmp_path / "m.gguf"
    write_file(path)
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    with open_mem(bytes(data)) as g2, open_path(path) as g3:
        assert g2.kvs() == g3.kvs()
        assert [t["name"] for t in g2.tensors()] == [t["name"] for t in g3.tensors()]


def test_lookup_out_of_range(tmp_path):
    path = tmp_path / "m.gguf"
    write_file(path)
    with open_path(path) as g:
        assert lib.gh_gguf_tensor_name(g.h, -1) == ffi.NULL
        assert lib.gh_gguf_tensor_name(g.h, g.n_tensors) == ffi.NULL
        assert lib.gh_gguf_kv_key(g.h, g.n_kv) == ffi.NULL
        assert lib.gh_gguf_kv_type(g.h, -1) == -1
        assert lib.gh_gguf_find_key(g.h, b"no.such.key") == -1
        i = lib.gh_gguf_find_key(g.h, b"t.str")
        with pytest.raises(NativeError, match="expected an integer"):
            check(lib.gh_gguf_kv_int(g.h, i, ffi.new("int64_t *")))
        with pytest.raises(NativeError):
            check(lib.gh_gguf_tensor_info(g.h, 99, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL,
                                          ffi.NULL, ffi.NULL))


# The internal typed getters (gguf.h) the model loader uses; the library exports them.
_iffi = cffi.FFI()
_iffi.cdef("""
typedef struct gh_gguf gh_gguf;
bool gh_gguf_get_u32(const gh_gguf * g, const char * key, uint32_t * out, bool * err);
bool gh_gguf_get_f32(const gh_gguf * g, const char * key, float * out, bool * err);
bool gh_gguf_get_bool(const gh_gguf * g, const char * key, bool * out, bool * err);
const char * gh_gguf_get_str(const gh_gguf * g, const char * key);
int64_t gh_gguf_get_arr_n(const gh_gguf * g, const char * key);
""")
_ilib = _iffi.dlopen(str(lib_path))


def test_internal_typed_getters(tmp_path):
    path = tmp_path / "m.gguf"
    write_file(path)
    with open_path(path) as g:
        h = _iffi.cast("gh_gguf *", int(ffi.cast("uintptr_t", g.h)))
        u, f, b, err = _iffi.new("uint32_t *"), _iffi.new("float *"), _iffi.new("bool *"), _iffi.new("bool *")

        def u32(key):
            err[0] = False
            ok = _ilib.gh_gguf_get_u32(h, key, u, err)
            return (u[0] if ok else None), err[0]

        assert u32(b"t.u32") == (4_000_000_000, False)
        assert u32(b"t.u8") == (250, False)
        assert u32(b"t.i8") == (None, True)       # negative
        assert u32(b"t.u64") == (None, True)      # out of range
        assert u32(b"t.str") == (None, True)      # wrong type
        assert u32(b"missing") == (None, False)
        err[0] = False
        assert _ilib.gh_gguf_get_f32(h, b"t.f32", f, err) and f[0] == 0.5
        assert _ilib.gh_gguf_get_f32(h, b"t.i16", f, err) and f[0] == -32000.0
        assert not _ilib.gh_gguf_get_f32(h, b"t.arr.f32", f, err) and err[0]
        err[0] = False
        assert _ilib.gh_gguf_get_bool(h, b"t.true", b, err) and b[0]
        assert _ilib.gh_gguf_get_bool(h, b"t.false", b, err) and not b[0]
        assert not _ilib.gh_gguf_get_bool(h, b"t.u8", b, err) and err[0]
        assert _iffi.string(_ilib.gh_gguf_get_str(h, b"t.str")).decode() == "héllo wörld ✓"
        assert _ilib.gh_gguf_get_str(h, b"t.u8") == _iffi.NULL
        assert _ilib.gh_gguf_get_arr_n(h, b"t.arr.str") == 4
        assert _ilib.gh_gguf_get_arr_n(h, b"t.str") == -1


# ---- bad files ----

def test_missing_file(tmp_path):
    p = tmp_path / "nope.gguf"
    with pytest.raises(NativeError) as ei:
        open_path(p)
    assert ei.value.status == lib.GH_ERR_IO
    assert str(ei.value) == f"cannot open '{p}': No such file or directory"


def test_directory(tmp_path):
    with pytest.raises(NativeError, match="is a directory") as ei:
        open_path(tmp_path)
    assert ei.value.status == lib.GH_ERR_IO and str(tmp_path) in str(ei.value)


def test_fifo_is_not_a_regular_file(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    with pytest.raises(NativeError, match="not a regular file"):
        open_path(p)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.gguf"
    p.write_bytes(b"")
    with pytest.raises(NativeError, match="file is empty") as ei:
        open_path(p)
    assert ei.value.status == lib.GH_ERR_FORMAT and str(p) in str(ei.value)
    expect_error(b"", lib.GH_ERR_FORMAT, "file is empty")


def small_valid_file(tmp_path) -> bytes:
    """~1 KB: every kind of key and three tensors."""
    rng = np.random.default_rng(1)
    path = tmp_path / "small.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_uint32("a.u32", 7)
    w.add_float32("a.f32", 1.25)
    w.add_bool("a.bool", True)
    w.add_string("a.str", "hello")
    w.add_array("a.tokens", ["<s>", "</s>", "a", "b"])
    w.add_array("a.scores", [0.0, -1.0, -2.0, -3.0])
    w.add_tensor("t.f32", rng.standard_normal(8).astype(np.float32))
    w.add_tensor("t.q8", quant_bytes(rng, QT.Q8_0, 2, 32), raw_dtype=QT.Q8_0)
    w.add_tensor("t.f16", rng.standard_normal(16).astype(np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


def test_truncated_at_every_length(tmp_path):
    data = small_valid_file(tmp_path)
    assert 500 < len(data) < 1500
    with open_mem(data) as g:
        end = max(t["offset"] + t["nbytes"] for t in g.tensors())
        data_start = int(ffi.cast("uintptr_t", g.tensors()[0]["data"])) - \
            int(ffi.cast("uintptr_t", g.buf[1])) - g.tensors()[0]["offset"]
    needed = data_start + end  # GGUFWriter pads after the last tensor; that padding is optional
    for n in range(len(data)):
        if n < needed:
            expect_error(data[:n], lib.GH_ERR_FORMAT)
        else:
            open_mem(data[:n]).close()
    # The same through the file path, for a spread of lengths.
    p = tmp_path / "cut.gguf"
    for n in list(range(1, 40)) + list(range(40, needed, 13)):
        p.write_bytes(data[:n])
        with pytest.raises(NativeError) as ei:
            open_path(p)
        assert ei.value.status == lib.GH_ERR_FORMAT and str(p) in str(ei.value)


def test_bad_magic():
    expect_error(b"GGUX" + bytes(20), lib.GH_ERR_FORMAT, "bad magic")
    expect_error(b"GG", lib.GH_ERR_FORMAT, "bad magic")


@pytest.mark.parametrize("version,fragment", [(1, "version 1 is not supported"),
                                              (0, "unknown GGUF version 0"),
                                              (99, "unknown GGUF version 99"),
                                              (0x03000000, "big-endian")])
def test_bad_version(version, fragment):
    expect_error(image(version=version), lib.GH_ERR_UNSUPPORTED, fragment)


def test_huge_counts_rejected_before_allocation():
    expect_error(image(n_kv=10**9), lib.GH_ERR_FORMAT, "1000000000 keys", "cannot fit")
    expect_error(image(n_tensors=2**60), lib.GH_ERR_FORMAT, "1152921504606846976 tensors")
    expect_error(image(n_kv=2**64 - 1, n_tensors=2**64 - 1), lib.GH_ERR_FORMAT, "cannot fit")
    # Just one more key than there are bytes for.
    expect_error(image([kv_u32("a", 1)], n_kv=2) , lib.GH_ERR_FORMAT)


def test_string_lengths():
    # A key whose length runs past the end of the file.
    img = image(n_kv=1, align=1) + struct.pack("<Q", 1000) + b"abc" + bytes(20)
    expect_error(img, lib.GH_ERR_FORMAT, "claims 1000 bytes")
    img = image(n_kv=1, align=1) + struct.pack("<Q", 2**64 - 1) + bytes(20)
    expect_error(img, lib.GH_ERR_FORMAT, "claims 18446744073709551615 bytes")
    # A string value longer than the file.
    img = image([kv("s", VT.STRING, struct.pack("<Q", 500) + b"xy")], align=1)
    expect_error(img, lib.GH_ERR_FORMAT, "string value", "claims 500 bytes")
    # A string inside an array.
    arr = struct.pack("<IQ", VT.STRING, 2) + gstr("ok") + struct.pack("<Q", 2**63) + bytes(8)
    expect_error(image([kv("a", VT.ARRAY, arr)], align=1), lib.GH_ERR_FORMAT, "array string")
    # An array of strings whose count cannot fit.
    arr = struct.pack("<IQ", VT.STRING, 2**61) + gstr("x")
    expect_error(image([kv("a", VT.ARRAY, arr)], align=1), lib.GH_ERR_FORMAT, "2305843009213693952 strings")
    # Numeric array whose byte size overflows / does not fit.
    arr = struct.pack("<IQ", VT.UINT64, 2**62) + bytes(16)
    expect_error(image([kv("a", VT.ARRAY, arr)], align=1), lib.GH_ERR_FORMAT, "does not fit")
    # A key too long to be sane (but present in the file).
    big = "k" * (64 * 1024 + 1)
    expect_error(image([kv_u32(big, 1)]), lib.GH_ERR_FORMAT, "too long")
    # Empty keys, keys with NUL bytes.
    expect_error(image([kv_u32("", 1)]), lib.GH_ERR_FORMAT, "is empty")
    expect_error(image([kv_u32(b"a\0b", 1)]), lib.GH_ERR_FORMAT, "NUL byte")
    expect_error(image([kv("s", VT.STRING, gstr(b"x\0y"))]), lib.GH_ERR_FORMAT, "NUL byte")
    # Keys and tensor names must be UTF-8 (string values are not checked).
    for bad in (b"a\x80", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"ab\xe2\x82"):
        expect_error(image([kv_u32(bad, 1)]), lib.GH_ERR_FORMAT, "not valid UTF-8")
        expect_error(image(tensors=[tinfo(bad, [1])], data=bytes(32)), lib.GH_ERR_FORMAT, "not valid UTF-8")
    with open_mem(image([kv_u32("ключ.✓.😀", 1), kv("s", VT.STRING, gstr(b"\xff"))])) as g:
        assert g.kvs() == {"ключ.✓.😀": (VT.UINT32, 1), "s": (VT.STRING, "\ufffd")}


def test_value_types():
    expect_error(image([kv("k", 13, bytes(8))]), lib.GH_ERR_FORMAT, "key 'k': unknown value type 13")
    expect_error(image([kv("k", 0xFFFFFFFF, bytes(8))]), lib.GH_ERR_FORMAT, "unknown value type 4294967295")
    expect_error(image([kv("k", VT.ARRAY, struct.pack("<IQ", 77, 1) + bytes(8))]), lib.GH_ERR_FORMAT,
                 "unknown array element type 77")
    nested = struct.pack("<IQ", VT.ARRAY, 1) + struct.pack("<IQ", VT.UINT8, 1) + b"\1"
    expect_error(image([kv("k", VT.ARRAY, nested)]), lib.GH_ERR_UNSUPPORTED, "nested arrays")
    expect_error(image([kv("k", VT.BOOL, b"\2")]), lib.GH_ERR_FORMAT, "bool value 2")
    expect_error(image([kv("k", VT.ARRAY, struct.pack("<IQ", VT.BOOL, 2) + b"\1\3")]),
                 lib.GH_ERR_FORMAT, "bool element 1")
    # Empty arrays are fine.
    with open_mem(image([kv("k", VT.ARRAY, struct.pack("<IQ", VT.STRING, 0))])) as g:
        assert g.kvs() == {"k": (VT.ARRAY, (VT.STRING, 0))}


def test_duplicates():
    expect_error(image([kv_u32("a", 1), kv_u32("b", 2), kv_u32("a", 3)]), lib.GH_ERR_FORMAT,
                 "duplicate key 'a'")
    ts = [tinfo("w", [8]), tinfo("w", [8], offset=32)]
    expect_error(image(tensors=ts, data=bytes(64)), lib.GH_ERR_FORMAT, "duplicate tensor name 'w'")


def test_many_keys_hash_table():
    keys = [kv_u32(f"key.{i}", i) for i in range(3000)]
    with open_mem(image(keys)) as g:
        assert g.n_kv == 3000
        for i in (0, 1234, 2999):
            assert lib.gh_gguf_find_key(g.h, f"key.{i}".encode()) == i
    expect_error(image(keys + [kv_u32("key.2999", 0)]), lib.GH_ERR_FORMAT, "duplicate key 'key.2999'")


def test_tensor_types():
    # refusals name the type as ggml does (Q6_K, not "type 14")
    for typ, name in ((9, "Q8_1"), (34, "TQ1_0"), (15, "Q8_K"), (35, "TQ2_0"),
                      (31, "unknown"), (1000, "unknown")):
        expect_error(image(tensors=[tinfo("w", [32], typ)], data=bytes(4096)), lib.GH_ERR_UNSUPPORTED,
                     f"tensor 'w' has type {name} (id {typ}), which this runtime does not read")
    expect_error(image(tensors=[tinfo("w", [16], QT.Q8_0)], data=bytes(64)), lib.GH_ERR_FORMAT,
                 "not a multiple of the q8_0 block size 32")
    expect_error(image(tensors=[tinfo("w", [33, 2], QT.Q4_0)], data=bytes(256)), lib.GH_ERR_FORMAT,
                 "block size")
    # K-quants are read; a row must be whole 256-blocks
    for typ, name in ((QT.Q4_K, "Q4_K"), (QT.Q5_K, "Q5_K"), (QT.Q6_K, "Q6_K"), (QT.Q2_K, "Q2_K"),
                      (QT.Q3_K, "Q3_K")):
        expect_error(image(tensors=[tinfo("w", [288], typ)], data=bytes(4096)), lib.GH_ERR_FORMAT,
                     f"not a multiple of the {name} block size 256")


def test_tensor_dims():
    expect_error(image(tensors=[tinfo("w", [])], data=bytes(32)), lib.GH_ERR_FORMAT, "n_dims 0 is not in 1..4")
    expect_error(image(tensors=[tinfo("w", [1] * 5)], data=bytes(32)), lib.GH_ERR_FORMAT, "n_dims 5")
    expect_error(image(tensors=[tinfo("w", [2**62, 2**62])]), lib.GH_ERR_FORMAT, "element count overflows")
    expect_error(image(tensors=[tinfo("w", [2**40, 2**40, 2**40])]), lib.GH_ERR_FORMAT, "overflows")
    expect_error(image(tensors=[tinfo("w", [2**62 + 1])]), lib.GH_ERR_FORMAT, "max 2^62")
    expect_error(image(tensors=[tinfo("w", [2**64 - 1])]), lib.GH_ERR_FORMAT, "max 2^62")
    expect_error(image(tensors=[tinfo("w", [2**62])]), lib.GH_ERR_FORMAT, "byte size overflows")
    expect_error(image(tensors=[tinfo("w", [2**60])], data=bytes(64)), lib.GH_ERR_FORMAT,
                 "extends past the end of the file")
    expect_error(image(tensors=[tinfo("", [1])], data=bytes(32)), lib.GH_ERR_FORMAT, "tensor name 0 at offset", "is empty")
    # Zero-size dimensions are valid (an empty tensor).
    with open_mem(image(tensors=[tinfo("w", [0, 3])])) as g:
        assert g.tensors()[0]["nbytes"] == 0


def test_tensor_data_bounds_and_alignment():
    ok = image(tensors=[tinfo("a", [8]), tinfo("b", [8], offset=32)], data=bytes(64))
    with open_mem(ok) as g:
        assert [t["offset"] for t in g.tensors()] == [0, 32]
    expect_error(image(tensors=[tinfo("a", [8]), tinfo("b", [8], offset=32)], data=bytes(63)),
                 lib.GH_ERR_FORMAT, "tensor 'b'", "extends past the end of the file")
    expect_error(image(tensors=[tinfo("a", [8], offset=2**64 - 32)], data=bytes(64)),
                 lib.GH_ERR_FORMAT, "extends past the end")
    expect_error(image(tensors=[tinfo("a", [8], offset=4)], data=bytes(64)), lib.GH_ERR_FORMAT,
                 "offset 4 is not a multiple of the alignment 32")
    expect_error(image(tensors=[tinfo("a", [16]), tinfo("b", [8], offset=32)], data=bytes(96)),
                 lib.GH_ERR_FORMAT, "tensors 'a' and 'b' overlap")
    # A header whose padding to the data section is missing entirely.
    no_pad = image(tensors=[tinfo("a", [1])], align=1)
    expect_error(no_pad, lib.GH_ERR_FORMAT, "extends past the end")


@pytest.mark.parametrize("align", [0, 3, 48, 2**31 + 1])
def test_bad_alignment(align):
    expect_error(image([kv_u32("general.alignment", align)]), lib.GH_ERR_FORMAT,
                 f"general.alignment = {align} is not a power of two")


def test_alignment_key_types():
    expect_error(image([kv("general.alignment", VT.STRING, gstr("32"))]), lib.GH_ERR_FORMAT,
                 "general.alignment", "expected an unsigned integer, found string")
    expect_error(image([kv("general.alignment", VT.INT32, struct.pack("<i", -32))]), lib.GH_ERR_FORMAT,
                 "out of range")
    for a in (1, 2, 16, 256):
        kvs = [kv_u32("general.alignment", a)]
        img = image(kvs, tensors=[tinfo("w", [4], offset=0)], align=a, data=bytes(16))
        with open_mem(img) as g:
            walk(g, img)


def test_random_mutations(tmp_path):
    """Seeded byte flips and field overwrites of a valid file: errors or success, never a crash."""
    data = small_valid_file(tmp_path)
    rng = random.Random(1234)
    outcomes = {"ok": 0, "error": 0}
    for _ in range(600):
        m = bytearray(data)
        for _ in range(rng.choice((1, 1, 2, 4, 16))):
            i = rng.randrange(len(m))
            r = rng.random()
            if r < 0.5:
                m[i] ^= 1 << rng.randrange(8)
            elif r < 0.8:
                m[i] = rng.choice((0, 0xFF, 0x7F, 0x80, rng.randrange(256)))
            else:  # overwrite an 8-byte field with an extreme value
                v = rng.choice((0, 1, 2**32, 2**62, 2**63, 2**64 - 1, rng.randrange(2**64)))
                m[i:i + 8] = struct.pack("<Q", v)[:len(m) - i]
        if rng.random() < 0.2:
            m = m[:rng.randrange(len(m))]
        m = bytes(m)
        try:
            g = open_mem(m)
        except NativeError as e:
            assert e.status in (lib.GH_ERR_FORMAT, lib.GH_ERR_UNSUPPORTED), str(e)
            assert str(e).startswith("GGUF '<memory>': ")
            outcomes["error"] += 1
            continue
        with g:
            walk(g, m)
        outcomes["ok"] += 1
    assert outcomes["error"] > 100 and outcomes["ok"] > 10, outcomes


@pytest.mark.parametrize("path", sorted(REGRESSIONS.glob("*")) if REGRESSIONS.is_dir() else [],
                         ids=lambda p: p.name)
def test_regression_inputs(path):
    """Kept inputs (fuzzer finds, hand-made hostile files) never crash the reader;
    those named reject-* must be refused with an error."""
    data = path.read_bytes()
    must_reject = path.name.startswith("reject-")
    try:
        g = open_mem(data)
    except NativeError:
        pass
    else:
        assert not must_reject, f"{path.name} was accepted"
        with g:
            walk(g, data)
    try:
        open_path(path).close()
    except NativeError:
        pass
    else:
        assert not must_reject, f"{path.name} was accepted from a file"
