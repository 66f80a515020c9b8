"""The TMA tensor maps' host side (cupyflash/_tma.py) and the FwdTmaParams mirror,
with a fake encode function: no libcuda needed."""

from __future__ import annotations

import ctypes
import re

import pytest

from cupyflash import _params, _tma
from cupyflash._sources import kernels_dir


class FakeEncode:
    """Records cuTensorMapEncodeTiled's arguments as plain values and writes a
    descriptor that names the address."""

    def __init__(self, result=0):
        self.calls, self.result = [], result

    def __call__(self, out, data_type, rank, address, dims, strides, box, element_strides, interleave, swizzle,
                 l2, oob):
        self.calls.append(dict(data_type=data_type, rank=rank, address=address.value, dims=tuple(dims),
                               strides=tuple(strides), box=tuple(box), element_strides=tuple(element_strides),
                               interleave=interleave, swizzle=swizzle, l2=l2, oob=oob))
        desc = out._obj
        ctypes.memset(desc, 0, len(desc))
        for i, byte in enumerate((address.value or 0).to_bytes(8, "little")):
            desc[i] = byte
        return self.result


def test_seq_map_is_innermost_first_with_byte_strides():
    # a (2, 1000, 8, 128) view with rows of 3 * 8 * 128 elements (a packed qkv)
    m = _tma.seq_map("bfloat16", (2, 1000, 8, 128), (1000 * 3072, 3072, 128), 2, 128)
    assert m.data_type == 9
    assert m.dims == (128, 1000, 8, 2)
    assert m.strides == (3072 * 2, 128 * 2, 1000 * 3072 * 2)
    assert m.box == (64, 128, 1, 1)
    assert _tma.seq_map("float16", (1, 5, 1, 64), (0, 64, 0), 2, 128).data_type == 6


def test_seq_map_size_one_dimensions_take_any_stride():
    m = _tma.seq_map("float16", (1, 300, 1, 64), (0, 64, 7), 2, 128)
    assert m.strides == (128, 16, 16)


@pytest.mark.parametrize("strides", [(1000 * 512, 500, 64), (1000 * 512, 512, 60)])
def test_seq_map_refuses_strides_off_16_bytes(strides):
    with pytest.raises(ValueError, match="multiples of 16 bytes"):
        _tma.seq_map("float16", (2, 1000, 8, 64), strides, 2, 128)


def test_encode_marshals_the_arguments():
    fake = FakeEncode()
    m = _tma.seq_map("bfloat16", (2, 1000, 8, 128), (1000 * 1024, 1024, 128), 2, 64)
    desc = _tma.encode(m, 0x7F0000001000, fake)
    assert len(desc) == _tma.DESCRIPTOR_BYTES
    assert desc[:8] == (0x7F0000001000).to_bytes(8, "little")
    (call,) = fake.calls
    assert call == dict(data_type=9, rank=4, address=0x7F0000001000, dims=(128, 1000, 8, 2),
                        strides=(2048, 256, 2048 * 1000), box=(64, 64, 1, 1), element_strides=(1, 1, 1, 1),
                        interleave=0, swizzle=3, l2=3, oob=0)


def test_encode_reports_a_driver_error():
    m = _tma.seq_map("float16", (1, 10, 1, 64), (0, 64, 64), 2, 128)
    with pytest.raises(RuntimeError, match="CUresult 1"):
        _tma.encode(m, 0x1000, FakeEncode(result=1))


def test_map_cache_encodes_each_address_once():
    fake = FakeEncode()
    maps = [_tma.seq_map("float16", (1, 10, 1, 64), (0, 64, 64), 2, rows) for rows in (128, 128, 128)]
    cache = _tma.MapCache(maps, fake, limit=4)
    first = cache(0x1000, 0x2000, 0x3000)
    assert len(first) == 3 * _tma.DESCRIPTOR_BYTES and len(fake.calls) == 3
    assert cache(0x1000, 0x2000, 0x3000) == first and len(fake.calls) == 3
    second = cache(0x1000, 0x2000, 0x4000)  # only v moved
    assert len(fake.calls) == 4 and second[:256] == first[:256] and second[256:264] == (0x4000).to_bytes(8, "little")
    for i in range(8):  # past the limit: forgotten all at once, still right
        assert cache(0x1000, 0x2000, 0x5000 + 16 * i)[256:264] == (0x5000 + 16 * i).to_bytes(8, "little")


def test_fwd_tma_params_layout():
    """FwdParams first (the launcher's pointer writes at offset 0), then the three maps
    back to back at 64-byte multiples (the kernel's TmaDescriptor alignment)."""
    s = _params.FWD_TMA_PARAMS
    assert s.fields["fwd"][1] == 0 and s.fields["fwd"][0] == _params.FWD_PARAMS
    offsets = [s.fields[n][1] for n in ("q_map", "k_map", "v_map")]
    assert offsets[0] >= _params.FWD_PARAMS.itemsize and offsets[0] % 64 == 0
    assert offsets[1] == offsets[0] + 128 and offsets[2] == offsets[1] + 128
    assert s.itemsize % 64 == 0 and s.itemsize >= offsets[2] + 128
    assert f"-DCUPYFLASH_FWD_TMA_PARAMS_BYTES={s.itemsize}" in _params.size_defines()


def test_fwd_tma_params_mirror_names_the_c_fields():
    text = (kernels_dir() / "params.cuh").read_text()
    body = re.search(r"struct FwdTmaParams {(.*?)\n};", text, re.S).group(1)
    assert " ".join(body.split()) == "FwdParams fwd; TmaDescriptor q_map, k_map, v_map;"
    assert re.search(r"struct alignas\(64\) TmaDescriptor {\s*uint64 opaque\[16\];",
                     (kernels_dir() / "tma.cuh").read_text())


def test_box_cols_match_the_kernel():
    text = (kernels_dir() / "flash_fwd_ws.cu").read_text()
    assert re.search(rf"BOX_COLS = {_tma.BOX_COLS};", text)
