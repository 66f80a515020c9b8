"""Kernels compile through NVRTC with no spills (no GPU needed, only cupy + NVRTC)."""

from __future__ import annotations

import pytest

from cupyflash import dispatch


def _nvrtc_or_skip():
    try:
        from cupy.cuda import nvrtc
        nvrtc.getVersion()
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC unavailable (install cupyflash[cuda13]): {type(exc).__name__}: {exc}")
    from cupyflash import _compile
    try:
        _compile.cuda_include_dir()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    return _compile


@pytest.mark.parametrize("arch", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
@pytest.mark.parametrize("head_dim,causal", [(64, False), (128, True), (256, False)])
def test_fwd_variant_compiles_without_spills(arch, head_dim, causal):
    _compile = _nvrtc_or_skip()
    launch = dispatch.fwd_launch("float16", head_dim, causal, True, True, False, cc=arch)
    compiled = _compile.compile_variant(launch.source, launch.name_expression, arch, use_cache=False)
    res = _compile.parse_ptxas_log(compiled.log)
    assert res.spill_bytes == 0 and res.stack_bytes == 0, (launch.name_expression, res)
    assert compiled.cubin[:4] == b"\x7fELF"


@pytest.mark.parametrize("head_dim,causal,even_k,variant", [(64, False, True, 0), (128, True, False, 0),
                                                           (64, True, True, dispatch.VAR_WINDOW),
                                                           (128, True, True, dispatch.VAR_DROPOUT)])
def test_wgmma_fwd_variant_compiles_for_sm90a_without_spills(head_dim, causal, even_k, variant):
    """(A window at D=64, within the 128 registers of two blocks per SM; dropout at
    D=128, the most registers.)"""
    _compile = _nvrtc_or_skip()
    launch = dispatch.fwd_sm90_launch("bfloat16", head_dim, causal, even_k, variant=variant)
    assert "-arch=sm_90a" in _compile.compile_options((9, 0))
    compiled = _compile.compile_variant(launch.source, launch.name_expression, (9, 0), use_cache=False)
    res = _compile.parse_ptxas_log(compiled.log)
    assert res.spill_bytes == 0 and res.stack_bytes == 0, (launch.name_expression, res)
    assert "sm_90a" in compiled.log and "warning" not in compiled.log.lower(), compiled.log


def test_cache_key_covers_sources_and_variant(tmp_path, monkeypatch):
    _compile = _nvrtc_or_skip()
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))
    launch = dispatch.combine_launch("float16", 64)
    first = _compile.compile_variant(launch.source, launch.name_expression, (9, 0))
    assert len(list(tmp_path.glob("*.cubin"))) == 1
    again = _compile.compile_variant(launch.source, launch.name_expression, (9, 0))
    assert again.cubin == first.cubin and len(list(tmp_path.glob("*.cubin"))) == 1
    other = dispatch.combine_launch("float16", 128)
    _compile.compile_variant(other.source, other.name_expression, (9, 0))
    assert len(list(tmp_path.glob("*.cubin"))) == 2
    # A change to any kernel source changes every key.
    opts = _compile.compile_options((9, 0))
    key = _compile._cache_key(launch.source, launch.name_expression, opts)
    monkeypatch.setattr(_compile, "sources_hash", lambda: "something else")
    assert _compile._cache_key(launch.source, launch.name_expression, opts) != key


def test_ptxas_log_parser():
    from cupyflash import _compile

    log = ("ptxas info    : Function properties for k\n"
           "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    res = _compile.parse_ptxas_log(log)
    assert (res.registers, res.spill_bytes, res.stack_bytes) == (255, 12, 16)


def test_quick_selection_covers_the_wgmma_kernels_on_sm90_only():
    from cupyflash import check_kernels

    names = [L.template.rsplit("::", 1)[1] for L in check_kernels._launches((9, 0), True, None)]
    for kernel in ("flash_fwd_sm90_kernel", "flash_bwd_dkdv_sm90_kernel", "flash_bwd_dq_sm90_kernel"):
        assert names.count(kernel) == 4, kernel  # head_dim 64 and 128, causal or not
    assert not [L for L in check_kernels._launches((8, 0), True, None) if L.source.endswith("_sm90.cu")]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_quick_selection_holds_the_default_plans_wgmma_kernels(head_dim, causal):
    """--quick compiles what an fp16 default call on the H200 launches (at head_dim 64
    that is the dK/dV variant without dQ, then the dQ kernel; at 128 the warp-specialised
    dK/dV kernel)."""
    from cupyflash import check_kernels, dispatch

    quick = {L.name_expression for L in check_kernels._launches((9, 0), True, None)}
    shape = dict(batch=2, seqlen_q=1024, seqlen_k=1024, nheads_q=8, head_dim=head_dim, dtype="float16",
                 causal=causal, vec=True, cc=(9, 0))
    launches = [dispatch.select_fwd(**shape).main,
                *dispatch.select_bwd(nheads_kv=8, deterministic=False, **shape).launches]
    wgmma = [L for L in launches if L.source.endswith(("_sm90.cu", "_ws.cu"))]
    assert len(wgmma) == (3 if head_dim == 64 else 2)  # fwd, dK/dV (, dQ)
    for launch in wgmma:
        assert launch.name_expression in quick, launch.name_expression


def test_an_unwritable_cache_costs_a_warning_not_the_compile(tmp_path, monkeypatch):
    """Found by QA: with CUPYFLASH_CACHE_DIR (or ~/.cache) not writable -- a read-only home
    in a container or on a cluster -- compile_variant raised the OSError of its cache
    write, so every first call of a kernel failed on the GPU. The cache is only an
    optimisation: the compile now returns, with one RuntimeWarning per directory."""
    _compile = _nvrtc_or_skip()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(_compile, "_unwritable", set())
    launch = dispatch.combine_launch("float16", 64)
    with pytest.warns(RuntimeWarning, match=r"cannot write the kernel cache in .*a-file/cache .*CUPYFLASH_CACHE_DIR"):
        first = _compile.compile_variant(launch.source, launch.name_expression, (9, 0))
    assert first.cubin[:4] == b"\x7fELF"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per directory
        again = _compile.compile_variant(launch.source, launch.name_expression, (9, 0))
    assert again.cubin[:4] == b"\x7fELF" and again.lowered_name == first.lowered_name  # (cubins of two
    # compiles may differ in bytes NVRTC embeds)


def test_a_damaged_cache_entry_is_compiled_again(tmp_path, monkeypatch):
    """A cache entry whose JSON is damaged (a full disk, a hand edit) is recompiled and
    rewritten instead of failing the call with a JSONDecodeError."""
    _compile = _nvrtc_or_skip()
    monkeypatch.setenv("CUPYFLASH_CACHE_DIR", str(tmp_path))
    launch = dispatch.combine_launch("float16", 64)
    first = _compile.compile_variant(launch.source, launch.name_expression, (9, 0))
    (meta,) = tmp_path.glob("*.json")
    meta.write_text('{"lowered_na')
    again = _compile.compile_variant(launch.source, launch.name_expression, (9, 0))
    assert again.cubin[:4] == b"\x7fELF" and again.lowered_name == first.lowered_name
    assert '"lowered_name"' in meta.read_text()
