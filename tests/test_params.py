"""The params structs: the Python mirror against params.cuh, and packing by name."""

from __future__ import annotations

import operator
import re

import numpy as np
import pytest

from cupyflash import _params, _variant
from cupyflash._sources import kernels_dir

_C_TYPES = {"const void*": np.uint64, "void*": np.uint64, "float*": np.uint64, "const float*": np.uint64,
            "const int*": np.uint64, "int*": np.uint64, "const uint8*": np.uint64, "int64": np.int64, "int32": np.int32, "float": np.float32,
            "uint64": np.uint64, "uint32": np.uint32}
_NESTED = {"VariantParams": ("variant.cuh", _params.VARIANT_PARAMS)}


def _c_fields(struct_name, header="params.cuh"):
    """(name, numpy type) of each field of ``struct_name`` in a kernels_cu header, in
    order; a nested struct's type is its field list."""
    text = (kernels_dir() / header).read_text()
    body = re.search(rf"struct {struct_name} {{(.*?)\n}};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = []
    for declaration in body.split(";"):
        declaration = " ".join(declaration.split())
        if not declaration:
            continue
        nested = declaration.split(" ")[0]
        if nested in _NESTED:
            fields.append((declaration.split(" ")[1], _c_fields(nested, _NESTED[nested][0])))
            continue
        ctype = next(t for t in sorted(_C_TYPES, key=len, reverse=True) if declaration.startswith(t + " "))
        for name in declaration[len(ctype):].split(","):
            fields.append((name.strip(), np.dtype(_C_TYPES[ctype])))
    return fields


@pytest.mark.parametrize("struct_name, mirror", [("FwdParams", _params.FWD_PARAMS),
                                                 ("BwdParams", _params.BWD_PARAMS),
                                                 ("DecodeParams", _params.DECODE_PARAMS)])
def test_mirror_has_the_fields_of_the_c_struct_in_order(struct_name, mirror):
    # The size check (static_assert in params.cuh) cannot see two swapped fields of one type.
    assert _mirror_fields(mirror) == _c_fields(struct_name)


def _mirror_fields(mirror):
    return [(name, _mirror_fields(mirror.fields[name][0]) if mirror.fields[name][0].names else
             mirror.fields[name][0]) for name in mirror.names]


def test_variant_params_per_call_fields_lead():
    """The launcher writes VariantParams' per-call fields in one pack: they must be its first."""
    assert _params.VARIANT_PARAMS.names[:len(_params.VARIANT_PER_CALL)] == _params.VARIANT_PER_CALL
    assert set(_params.VARIANT_OFF) == set(_params.VARIANT_PARAMS.names)


def test_c_struct_parser_sees_a_swap():
    fields = _c_fields("FwdParams")
    assert fields[10] == ("q_batch_stride", np.dtype(np.int64))
    assert fields[11] == ("q_row_stride", np.dtype(np.int64))
    assert len(fields) == len(_params.FWD_PARAMS.names) == 36
    assert fields[-1][0] == "var" and len(fields[-1][1]) == len(_params.VARIANT_PARAMS.names)


@pytest.mark.parametrize("mirror", [_params.FWD_PARAMS, _params.BWD_PARAMS, _params.DECODE_PARAMS])
def test_pack_sets_every_field_by_name(mirror):
    values = {name: (i + 1) * 3 for i, name in enumerate(mirror.names) if name != "var"}
    var = {name: (i + 1) * 5 for i, name in enumerate(_params.VARIANT_PARAMS.names)}
    record = np.frombuffer(_params.pack(mirror, **values, var=var), dtype=mirror)[0]
    for name, value in values.items():
        assert record[name] == value, name
    for name, value in var.items():
        assert record["var"][name] == value, name


def test_pack_needs_every_field_and_no_other():
    values = dict.fromkeys(_params.FWD_PARAMS.names, 0)
    with pytest.raises(TypeError, match=r"missing \['softmax_scale'\]"):
        _params.pack(_params.FWD_PARAMS, **{n: v for n, v in values.items() if n != "softmax_scale"})
    with pytest.raises(TypeError, match=r"unknown \['scale'\]"):
        _params.pack(_params.FWD_PARAMS, **values, scale=1.0)


def test_field_writer_sets_only_its_fields():
    mirror = _params.BWD_PARAMS
    template = _params.pack(mirror, **{name: 7 for name in mirror.names if name != "var"},
                            var=dict(_params.VARIANT_OFF))
    names = ("q", "k", "v", "out")
    buffer = bytearray(template)
    _params.FieldWriter(mirror, names).pack_into(buffer, 101, 102, 103, 104)
    record = np.frombuffer(bytes(buffer), dtype=mirror)[0]
    for name in mirror.names:
        if name == "var":
            continue
        want = 101 + names.index(name) if name in names else 7
        assert record[name] == want, name


@pytest.mark.parametrize("names", [("k", "q"), ("k",), ("q", "v")])
def test_field_writer_needs_the_leading_fields_in_order(names):
    with pytest.raises(ValueError, match="not the struct's first fields in order"):
        _params.FieldWriter(_params.FWD_PARAMS, names)


def test_the_pointer_fields_lead_both_structs():
    from cupyflash import _gpu, _gpu_bwd

    assert _gpu.FWD_POINTERS == tuple(n for n in _params.FWD_PARAMS.names if _params.FWD_PARAMS[n] == np.uint64)
    assert _gpu_bwd.BWD_POINTERS == tuple(n for n in _params.BWD_PARAMS.names
                                          if _params.BWD_PARAMS[n] == np.uint64)


def _recording_launcher(template, maps=None, writer=None):
    """A Launcher with no kernels whose driver records the struct of each launch
    (``seen``): the launcher's writes, with no GPU. ``writer``: the pointer fields'
    FieldWriter (the forward's by default)."""
    import ctypes
    import threading

    from cupyflash import _gpu, _launch, _variant

    launcher = object.__new__(_launch.Launcher)
    seen = []
    launcher._launch_kernel = lambda *args: seen.append(bytes(launcher._buffer))
    launcher._kernels = ((None, 1, 1, 1, 1, 1, 1, 0),)
    launcher._buffer = ctypes.create_string_buffer(template, len(template))
    launcher._argv_address = 0
    launcher._pack_into = (writer or _gpu._FWD_WRITER).struct.pack_into
    launcher._var_offset, launcher._var_pack_into = _gpu._VAR_WRITER[0], _variant.WRITER.struct.pack_into
    launcher._maps_address, launcher._maps = (0, None) if maps is None else (
        ctypes.addressof(launcher._buffer) + maps[0], maps[1])
    launcher._map_pointers = operator.itemgetter(*((0, 1, 2) if maps is None or len(maps) < 3 else maps[2]))
    launcher._map_vars = () if maps is None or len(maps) < 4 else tuple(maps[3])
    launcher._lock = threading.Lock()
    return launcher, seen


def test_launcher_writes_the_variant_fields_of_a_call_with_var():
    """A call with ``var`` sets VariantParams' per-call fields in the struct it launches with
    (at the ``var`` member's offset) and nothing else of it; a plain call leaves them."""
    from cupyflash import _gpu

    mirror = _params.FWD_PARAMS
    fields = dict(_params.VARIANT_OFF, window_left=7, softcap_log2=2.5)
    template = _params.pack(mirror, **{n: 3 for n in mirror.names if n != "var"}, var=fields)
    launcher, seen = _recording_launcher(template)
    pointers = tuple(range(101, 101 + len(_gpu.FWD_POINTERS)))
    var = (11, 12, 13, 14, 15, 16, 17, 18, 2**40 + 5, 9)
    launcher(0, *pointers, var=var)
    launcher(0, *pointers)
    with_var, plain = (np.frombuffer(b[:mirror.itemsize], dtype=mirror)[0] for b in seen)
    assert [with_var["var"][n] for n in _params.VARIANT_PER_CALL] == list(var)
    assert with_var["var"]["window_left"] == 7 and with_var["var"]["softcap_log2"] == 2.5
    assert [with_var[n] for n in _gpu.FWD_POINTERS] == list(pointers) and with_var["batch"] == 3
    assert bytes(plain) == bytes(with_var)  # the last call's values stay until a call sets others


def test_launcher_writes_the_tma_maps_of_each_call():
    """A plan with TMA maps (FwdTmaParams) gets the maps of each call's q, k, v pointers
    at the maps' offset, after the FwdParams the pointers are written into."""
    from cupyflash import _gpu

    mirror = _params.FWD_TMA_PARAMS
    fwd = _params.pack(_params.FWD_PARAMS, **{n: 3 for n in _params.FWD_PARAMS.names if n != "var"},
                       var=_params.VARIANT_OFF)
    template = fwd + bytes(mirror.itemsize - len(fwd))

    def maps(q, k, v):
        return b"".join(bytes([x % 256]) * 128 for x in (q, k, v))

    launcher, seen = _recording_launcher(template, (_params.offset_of(mirror, "q_map"), maps))
    pointers = tuple(range(101, 101 + len(_gpu.FWD_POINTERS)))
    launcher(0, *pointers)
    launcher(0, 7, 8, 9, *pointers[3:])
    first, second = (np.frombuffer(b, dtype=mirror)[0] for b in seen)
    assert [first["fwd"][n] for n in _gpu.FWD_POINTERS] == list(pointers) and first["fwd"]["batch"] == 3
    assert bytes(first["q_map"]) == bytes([101]) * 128 and bytes(first["v_map"]) == bytes([103]) * 128
    assert bytes(second["k_map"]) == bytes([8]) * 128 and second["fwd"]["q"] == 7


def test_block_map_is_a_per_call_pointer_with_per_plan_strides():
    """VAR_BLOCK_MAP's fields: the map's pointer among the leading per-call ones (set by
    ``_variant.call_values``), its (batch, head, row, col) strides per plan, 0 along the
    mask's broadcast dimensions (``_variant.plan_fields`` with the kernel's tile)."""
    assert "block_map" in _params.VARIANT_PER_CALL
    assert _params.VARIANT_PER_CALL.index("block_map") < _params.VARIANT_PER_CALL.index("dropout_seed")
    assert _params.VARIANT_PARAMS.fields["block_map"][0] == np.uint64
    mask = np.ones((2, 1, 300, 1000), bool)  # per batch: head stride 0
    fields = _variant.plan_fields({"attn_mask": mask}, 0.5, 4, block_map_tile=(128, 64))
    # (2, 1, 3, 16) uint8, C-contiguous
    assert [fields[f"block_map_{a}_stride"] for a in ("batch", "head", "row", "col")] == [48, 0, 16, 1]
    fields = _variant.plan_fields({"attn_mask": mask[:, :, :1]}, 0.5, 4, block_map_tile=(128, 64))
    assert [fields[f"block_map_{a}_stride"] for a in ("batch", "head", "row", "col")] == [16, 0, 0, 1]
    assert all(_variant.plan_fields({"attn_mask": mask}, 0.5, 4)[f"block_map_{a}_stride"] == 0
               for a in ("batch", "head", "row", "col"))


def test_the_backward_s_two_maps_have_their_own_tiles():
    """The dK/dV kernel's map (``kv_block_map``, a per-call pointer beside ``block_map``) at
    its own tile: ``plan_fields`` sets each map's strides from its tile alone."""
    assert _params.VARIANT_PER_CALL.index("kv_block_map") == _params.VARIANT_PER_CALL.index("block_map") + 1
    mask = np.ones((2, 1, 300, 1000), bool)
    fields = _variant.plan_fields({"attn_mask": mask}, 0.5, 4, block_map_tile=(128, 64), kv_block_map_tile=(64, 128))
    # (2, 1, 3, 16) and (2, 1, 5, 8) uint8, C-contiguous
    assert [fields[f"block_map_{a}_stride"] for a in ("batch", "head", "row", "col")] == [48, 0, 16, 1]
    assert [fields[f"kv_block_map_{a}_stride"] for a in ("batch", "head", "row", "col")] == [40, 0, 8, 1]
    fields = _variant.plan_fields({"attn_mask": mask}, 0.5, 4, kv_block_map_tile=(64, 128))
    assert all(fields[f"block_map_{a}_stride"] == 0 for a in ("batch", "head", "row", "col"))
