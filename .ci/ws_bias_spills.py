"""The ws forward with a bias (VAR_BIAS) beside every subset of {window, softcap, ALiBi, sinks},
at the given padded head_dims, causal or not, packed or not, persistent or not (sm_90, this
machine's NVRTC; no GPU): one JSON line (head_dim, VARIANT, causal, varlen, persistent,
spill bytes) each. The source of dispatch._FWD_WS_SPILLS's bias entries.
usage: python .ci/ws_bias_spills.py 64 128 192 256"""
import sys, itertools, json, pathlib, concurrent.futures as cf
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
TILE = {64: (128, 4), 128: (128, 3), 192: (64, 3), 256: (64, 2)}  # dispatch.fwd_ws_tile with a bias
def one(item):
    from cupyflash import _compile
    d, bits, causal, varlen, per = item
    bn, st = TILE[d]
    e = (f"cupyflash::flash_fwd_ws_kernel<__nv_bfloat16, {d}, 128, {bn}, {st}, {str(causal).lower()}, true, "
         f"{bits}, {str(varlen).lower()}, {str(per).lower()}>")
    try:
        c = _compile.compile_variant("flash_fwd_ws.cu", e, (9, 0), use_cache=False)
        r = _compile.parse_ptxas_log(c.log)
        return (d, bits, causal, varlen, per, r.spill_bytes)
    except Exception as ex:
        return (d, bits, causal, varlen, per, f"ERR {str(ex)[:200]}")
items = []
for d in map(int, sys.argv[1:]):
    for k in range(16):
        bits = 32 | sum(b for i, b in enumerate((1, 2, 4, 8)) if k >> i & 1)
        for causal in (False, True):
            for varlen, per in ((False, False), (False, True), (True, False)):
                items.append((d, bits, causal, varlen, per))
with cf.ProcessPoolExecutor(2) as ex:
    for r in ex.map(one, items):
        print(json.dumps(r), flush=True)
