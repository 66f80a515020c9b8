"""``python -m cupyflash bench --suite bias``: additive bias and boolean masks (issue 14).

At head_dim 64 and 128, nheads = 2048 / head_dim, batch * seqlen = 16384 tokens
(seqlen 1024, 4096 and 8192 by default), bfloat16, non-causal, for the forward
and the backward (the backward with the bias's gradient):

- **ours** through the public functions (``flash_attn_fwd(..., attn_bias=)``,
  ``flash_attn_bwd(..., attn_bias=, return_dbias=True)`` on cupy arrays);
- **sdpa**: torch's ``scaled_dot_product_attention(attn_mask=bias)`` with its
  cuDNN and memory-efficient backends forced in turn (``sdpa_cudnn``,
  ``sdpa_efficient``), the bias a leaf that requires grad;
- **flex**: torch's compiled ``flex_attention`` with the bias read by a
  ``score_mod`` (a captured tensor that requires grad).

Each reads the same bias tensor, of one of the shapes of :data:`BIAS_SHAPES`:
``(1, H, N, N)`` (one per head, shared by the batch: a pair or relative-position
bias) or ``(B, 1, N, N)`` (one per sequence, shared by the heads).  The
``plain`` case (no bias) is the reference of the bandwidth and sparsity
figures, and ``sparse`` a boolean ``(1, 1, N, N)`` mask whose
:data:`SPARSE_BLOCK`-square blocks are empty with probability
:data:`SPARSE_EMPTY` (visible blocks all True; the diagonal blocks always
visible, so no row is empty); flex runs it as a block mask, ours as a
:class:`cupyflash.BlockMask` (both built once, outside the timed calls).

FLOPs are ``4 * B * H * N * N * D`` for every case (no pair is skipped:
the sparse case's figure is a time ratio), x2.5 for the backward.  The bias
stream's bandwidth is its bytes over ours' time (read once per call in the
forward; read and its fp32 gradient summed in the backward).

The bars (:func:`judge_bias`), for the two bias shapes:

- forward and backward time at most the faster SDPA backend's (ratio >= 1.0);
- FlexAttention's time at least 1.3 x ours;
- the 90%-empty block mask in at most 0.15 x the plain forward's time.

Device time (reasoned, not measured): per (head_dim, seqlen) ours and SDPA are
two timings of ~0.2 s each per case; flex compiles once per bias shape and
seqlen (8 compiles at the defaults of one dtype).
"""

from __future__ import annotations

import sys

import numpy as np

from . import bench
from ._bench_suites import ERROR, OOM, _number, cell, mark_failed, ratio
from ._bench_variants import (NOT_IMPLEMENTED, PASSES, OursVariant, _mark, check_status, count_checks,
                              flex_module, measure_passes, tflops)

BIAS_TOKENS = 16384
BIAS_HEAD_DIMS = (64, 128)
BIAS_SEQLENS = (1024, 4096, 8192)
BIAS_DTYPES = ("bfloat16",)
#: name -> the bias's shape for (batch, nheads, seqlen).
BIAS_SHAPES = {"heads": lambda b, h, n: (1, h, n, n), "batch": lambda b, h, n: (b, 1, n, n)}
CASES = ("plain", "heads", "batch", "sparse")
SPARSE_BLOCK = 128
SPARSE_EMPTY = 0.9
SPARSE_SEED = 14

SDPA_BAR = 1.0
FLEX_BAR = 1.3
SPARSE_BAR = 0.15
SDPA_BACKENDS = {"sdpa_cudnn": "CUDNN_ATTENTION", "sdpa_efficient": "EFFICIENT_ATTENTION"}
IMPLS = ("ours", *SDPA_BACKENDS, "flex")


# ----------------------------------------------------------------------------
# Pure pieces
# ----------------------------------------------------------------------------


def bias_shape(case, batch, nheads, seqlen):
    """The bias's (or the sparse mask's) 4-D shape for a case; None for ``plain``."""
    if case == "plain":
        return None
    if case == "sparse":
        return (1, 1, seqlen, seqlen)
    return BIAS_SHAPES[case](batch, nheads, seqlen)


def sparse_block_map(seqlen, block=SPARSE_BLOCK, empty=SPARSE_EMPTY, seed=SPARSE_SEED):
    """A ``(nblocks, nblocks)`` bool map: True = visible block; each off-diagonal block empty
    with probability ``empty``, the diagonal always visible (every row sees some key)."""
    n = -(-seqlen // block)
    rng = np.random.default_rng(seed)
    visible = rng.random((n, n)) >= empty
    np.fill_diagonal(visible, True)
    return visible


def torch_mask_source(mask):
    """The bool array to hand ``torch.from_dlpack`` for ours' ``mask``: a
    :class:`cupyflash.BlockMask`'s own ``mask`` (read in place, never consumed as a
    capsule), or the array itself."""
    from ._blockmask import BlockMask  # noqa: PLC0415

    return mask.mask if isinstance(mask, BlockMask) else mask


def sparse_mask(seqlen, **kwargs):
    """The ``(seqlen, seqlen)`` bool mask of :func:`sparse_block_map` (blocks all True or all False)."""
    blocks = sparse_block_map(seqlen, **kwargs)
    block = kwargs.get("block", SPARSE_BLOCK)
    return np.repeat(np.repeat(blocks, block, 0), block, 1)[:seqlen, :seqlen]


def bias_flops(batch, nheads, head_dim, seqlen, bwd=False) -> float:
    """``4 * B * H * N * N * D``, x2.5 for the backward (non-causal, every pair)."""
    return 4.0 * batch * nheads * head_dim * seqlen * seqlen * (2.5 if bwd else 1.0)


def stream_bytes(shape, itemsize, bwd=False) -> int:
    """Bytes of the bias stream: the bias read once; the backward also reads it and
    writes its fp32 gradient (4 bytes per element of the bias's shape)."""
    n = int(np.prod(shape))
    return n * (itemsize + 4) if bwd else n * itemsize


def sdpa_best(r, pas):
    """The faster SDPA backend's time for one pass, or None if neither was measured."""
    times = [r.get(f"{name}_{pas}_ms") for name in SDPA_BACKENDS]
    times = [t for t in times if _number(t)]
    return min(times) if times else None


def add_figures(r, plain=None) -> None:
    """TFLOP/s, bias-stream TB/s and ratios of one result, in place (``plain``: the
    same (head_dim, seqlen, dtype)'s no-bias result)."""
    for pas in PASSES:
        flops = r[f"{pas}_flops"]
        for impl in IMPLS:
            t = tflops(flops, r.get(f"{impl}_{pas}_ms"))
            if t is not None:
                r[f"{impl}_{pas}_tflops"] = t
        ms = r.get(f"ours_{pas}_ms")
        if r.get(f"{pas}_stream_bytes") and _number(ms) and ms > 0:
            r[f"ours_{pas}_stream_tbps"] = r[f"{pas}_stream_bytes"] / ms / 1e9
        value = ratio(sdpa_best(r, pas), r.get(f"ours_{pas}_ms"))
        if value is not None:
            r[f"ratio_{pas}_vs_sdpa"] = value
        value = ratio(r.get(f"flex_{pas}_ms"), r.get(f"ours_{pas}_ms"))
        if value is not None:
            r[f"ratio_{pas}_vs_flex"] = value
        if plain is not None and plain is not r:
            value = ratio(r.get(f"ours_{pas}_ms"), plain.get(f"ours_{pas}_ms"))
            if value is not None:
                r[f"time_{pas}_vs_plain"] = value


def judge_result(r) -> list[dict]:
    """The bars of one result, in place (``bar_<pass>_<against>``); returns its checks."""
    checks = []
    rules = []
    if r["case"] in BIAS_SHAPES:
        rules = [("sdpa", f"ratio_{{pas}}_vs_sdpa", SDPA_BAR, True, PASSES),
                 ("flex", f"ratio_{{pas}}_vs_flex", FLEX_BAR, True, PASSES)]
    elif r["case"] == "sparse":
        rules = [("plain", "time_{pas}_vs_plain", SPARSE_BAR, False, ("fwd",))]
    for against, key, limit, at_least, passes in rules:
        for pas in passes:
            value = r.get(key.format(pas=pas))
            status = r[f"bar_{pas}_{against}"] = check_status(value, limit, at_least, r.get(f"ours_{pas}_ms"))
            checks.append({"case": r["case"], "head_dim": r["head_dim"], "seqlen": r["seqlen"], "dtype": r["dtype"],
                           "pass": pas, "against": against, "value": value, "limit": limit, "status": status})
    return checks


def judge_bias(results) -> list[dict]:
    """Figures (:func:`add_figures`) and bars (:func:`judge_result`) of every result, in place."""
    plains = {(r["head_dim"], r["seqlen"], r["dtype"]): r for r in results if r["case"] == "plain"}
    checks = []
    for r in results:
        add_figures(r, plains.get((r["head_dim"], r["seqlen"], r["dtype"])))
        checks += judge_result(r)
    return checks


def judge_report(report) -> None:
    checks = judge_bias(report["results"])
    report["bar_checks"], report["bars"] = checks, count_checks(checks)


# ----------------------------------------------------------------------------
# The implementations (each: prepare, forward, backward, wait, time_ms)
# ----------------------------------------------------------------------------


def ours_bias(cupy, *, dtype, softmax_scale, bias=None, mask=None):
    """ours (:class:`OursVariant`): ``flash_attn_fwd``/``flash_attn_bwd`` with ``attn_bias=``
    (the backward with ``return_dbias=True``) or ``attn_mask=``."""
    kwargs = {name: x for name, x in (("attn_bias", bias), ("attn_mask", mask)) if x is not None}
    return OursVariant(cupy, dtype=dtype, softmax_scale=softmax_scale, kwargs=kwargs,
                       bwd_kwargs={"return_dbias": True} if bias is not None else None)


def _torch_bhsd(torch, cupy, sets, dtype):
    """(B, H, S, D) contiguous torch copies of each set's q, k, v (leaves that require grad) and dout."""
    out = []
    for s in sets:
        q, k, v, dout = (bench.torch_view(torch, cupy, x, dtype).transpose(1, 2).contiguous() for x in s)
        out.append(((q.requires_grad_(), k.requires_grad_(), v.requires_grad_()), dout))
    return out


class SdpaBias:
    """torch SDPA with ``attn_mask`` = the bias (a leaf that requires grad) or the bool mask, one backend forced."""

    passes = PASSES

    def __init__(self, torch_env, cupy, name, *, dtype, softmax_scale, bias=None):
        self.torch, backends, self.sdpa_kernel = torch_env
        self.backend = getattr(backends, SDPA_BACKENDS[name])
        self.name, self.cupy, self.dtype, self.scale, self.bias = name, cupy, dtype, softmax_scale, bias

    def prepare(self, sets):
        return _torch_bhsd(self.torch, self.cupy, sets, self.dtype)

    def forward(self, state):
        (q, k, v), _ = state
        with self.sdpa_kernel(self.backend):
            return self.torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=self.bias,
                                                                         scale=self.scale)

    def backward(self, state, out):
        leaves, dout = state
        if self.bias is not None and self.bias.requires_grad:
            leaves = leaves + (self.bias,)
        with self.sdpa_kernel(self.backend):
            return self.torch.autograd.grad(out, leaves, dout, retain_graph=True)

    def wait(self, result):
        self.torch.cuda.synchronize()

    def time_ms(self, fn, reps):
        return bench._torch_time_ms(fn, reps, self.torch)  # noqa: SLF001


def flex_functions(flex_attention, softmax_scale):
    """The compiled-function bodies by case: the bias read by a score_mod (per head, or
    per sequence), and the sparse mask as a block mask."""
    scale = softmax_scale

    def heads(q, k, v, bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[0, h, q_idx, kv_idx]

        return flex_attention(q, k, v, score_mod=score_mod, scale=scale)

    def batch(q, k, v, bias):
        def score_mod(score, b, h, q_idx, kv_idx):
            return score + bias[b, 0, q_idx, kv_idx]

        return flex_attention(q, k, v, score_mod=score_mod, scale=scale)

    def sparse(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask, scale=scale)

    return {"heads": heads, "batch": batch, "sparse": sparse}


class FlexBias:
    """The compiled flex_attention for one case (compiled once per case, again per shape)."""

    name = "flex"
    passes = PASSES

    def __init__(self, env, cupy, case, *, dtype, extra):
        self.env, self.torch, self.cupy, self.dtype = env, env["torch"], cupy, dtype
        self.fn, self.extra = env["function"](case), extra

    def prepare(self, sets):
        return _torch_bhsd(self.torch, self.cupy, sets, self.dtype)

    def forward(self, state):
        return self.fn(*state[0], self.extra)

    def backward(self, state, out):
        leaves, dout = state
        if getattr(self.extra, "requires_grad", False):
            leaves = leaves + (self.extra,)
        return self.torch.autograd.grad(out, leaves, dout, retain_graph=True)

    def wait(self, result):
        self.torch.cuda.synchronize()

    def time_ms(self, fn, reps):
        return bench._torch_time_ms(fn, reps, self.torch)  # noqa: SLF001


def flex_env(torch_env, softmax_scale):
    """``({"torch", "function", "create_block_mask"}, None)``, or ``(None, why flex is not measured)``."""
    module, why = flex_module(torch_env)
    if module is None:
        return None, why
    torch = torch_env[0]
    bodies, compiled = flex_functions(module.flex_attention, softmax_scale), {}

    def function(case):
        if case not in compiled:
            compiled[case] = torch.compile(bodies[case], dynamic=False)
        return compiled[case]

    return {"torch": torch, "function": function, "create_block_mask": module.create_block_mask}, None


# ----------------------------------------------------------------------------
# The suite
# ----------------------------------------------------------------------------


def _bf16_or_f16(cupy, x32, dtype):
    return x32.astype(cupy.float16) if dtype == "float16" else bench._bf16_bits(cupy, x32)  # noqa: SLF001


def bias_result(case, *, head_dim, seqlen, dtype, batch, nheads, input_sets) -> dict:
    shape = bias_shape(case, batch, nheads, seqlen)
    res = {"case": case, "head_dim": head_dim, "seqlen": seqlen, "dtype": dtype, "batch": batch, "nheads": nheads,
           "bias_shape": None if shape is None else list(shape), "input_sets": input_sets,
           "fwd_flops": bias_flops(batch, nheads, head_dim, seqlen),
           "bwd_flops": bias_flops(batch, nheads, head_dim, seqlen, bwd=True)}
    if case in BIAS_SHAPES:
        res["fwd_stream_bytes"] = stream_bytes(shape, 2)
        res["bwd_stream_bytes"] = stream_bytes(shape, 2, bwd=True)
    if case == "sparse":
        res["visible_block_fraction"] = float(sparse_block_map(seqlen).mean())
    return res


def _progress(report, save, res, impl):
    judge_report(report)
    save()
    times = ", ".join(f"{p} {cell(res.get(f'{impl}_{p}_ms'), 0, '.3f')} ms" for p in PASSES)
    print(f"bias D={res['head_dim']} S={res['seqlen']} {res['case']}: {impl} {times}", file=sys.stderr, flush=True)


def bias_point(cupy, torch_env, flex, report, save, *, head_dim, seqlen, dtype, reps):
    """Every case at one (head_dim, seqlen, dtype): ours, the SDPA backends, then flex."""
    nheads = 2048 // head_dim
    batch = max(1, BIAS_TOKENS // seqlen)
    shape = (batch, seqlen, nheads, head_dim)
    scale = head_dim ** -0.5
    count = bench.rotation_count(bench.set_bytes(shape))
    sets = bench.input_sets(cupy, shape, dtype, count)
    torch = None if torch_env is None else torch_env[0]
    for case in CASES:
        res = bias_result(case, head_dim=head_dim, seqlen=seqlen, dtype=dtype, batch=batch, nheads=nheads,
                          input_sets=count)
        report["results"].append(res)
        try:
            bshape = bias_shape(case, batch, nheads, seqlen)
            bias = mask = None
            if case in BIAS_SHAPES:
                bias = _bf16_or_f16(cupy, cupy.random.standard_normal(bshape, dtype=cupy.float32), dtype)
            elif case == "sparse":
                import cupyflash  # noqa: PLC0415

                # mapped once, outside the timed calls (as flex's create_block_mask): the
                # wgmma forward skips its empty tiles and runs its full ones mask-free
                mask = cupyflash.BlockMask.from_mask(cupy.asarray(sparse_mask(seqlen)).reshape(bshape))
        except Exception as e:  # noqa: BLE001 - e.g. out of memory for the bias
            mark_failed(res, "ours", [f"ours_{p}_ms" for p in PASSES], e)
            _progress(report, save, res, "ours")
            continue
        try:
            measure_passes(ours_bias(cupy, dtype=dtype, softmax_scale=scale, bias=bias, mask=mask), sets, res, reps)
        except Exception as e:  # noqa: BLE001
            _mark(res, "ours", [f"ours_{p}_ms" for p in PASSES], e)
        _progress(report, save, res, "ours")
        if torch is not None:
            tbias = None
            if bias is not None:
                tbias = bench.torch_view(torch, cupy, bias, dtype).detach().clone().requires_grad_()
            elif mask is not None:
                # the BlockMask's bool array (a BlockMask is no DLPack producer: torch takes
                # it for a capsule and refuses it)
                tbias = torch.from_dlpack(torch_mask_source(mask))
            for name in SDPA_BACKENDS:
                try:
                    impl = SdpaBias(torch_env, cupy, name, dtype=dtype, softmax_scale=scale, bias=tbias)
                    measure_passes(impl, sets, res, reps)
                except Exception as e:  # noqa: BLE001 - a backend that refuses the shape or the bias
                    mark_failed(res, name, [f"{name}_{p}_ms" for p in PASSES], e)
                _progress(report, save, res, name)
            if flex is not None and case != "plain":
                try:
                    extra = tbias
                    if case == "sparse":
                        blocks = torch.from_dlpack(cupy.asarray(sparse_block_map(seqlen)))

                        def mask_mod(b, h, q_idx, kv_idx, blocks=blocks):
                            return blocks[q_idx // SPARSE_BLOCK, kv_idx // SPARSE_BLOCK]

                        extra = flex["create_block_mask"](mask_mod, None, None, seqlen, seqlen, device="cuda",
                                                          BLOCK_SIZE=SPARSE_BLOCK)
                    measure_passes(FlexBias(flex, cupy, case, dtype=dtype, extra=extra), sets, res, reps)
                except Exception as e:  # noqa: BLE001
                    mark_failed(res, "flex", [f"flex_{p}_ms" for p in PASSES], e)
                _progress(report, save, res, "flex")
            torch.cuda.empty_cache()
        del bias, mask
        cupy.get_default_memory_pool().free_all_blocks()
    del sets
    cupy.get_default_memory_pool().free_all_blocks()


def bar_rules() -> dict[str, str]:
    shapes = " and ".join(f"{n} {BIAS_SHAPES[n]('B', 'H', 'N')}".replace("'", "") for n in BIAS_SHAPES)
    return {"sdpa": f"{shapes}: time <= the faster of SDPA cuDNN / mem-efficient (ratio >= {SDPA_BAR:g}), "
                    "forward and backward",
            "flex": f"{shapes}: FlexAttention's time >= {FLEX_BAR:g} x ours, forward and backward",
            "sparse": f"a {SPARSE_EMPTY:.0%}-empty {SPARSE_BLOCK}-block mask: forward time <= {SPARSE_BAR:g} x "
                      "the plain forward's"}


def run_bias(cupy, args, report, save):
    """``--suite bias``: --head-dim, --seqlen, --dtype pick the points; --no-torch drops SDPA and flex."""
    head_dims = args.head_dim or list(BIAS_HEAD_DIMS)
    seqlens = args.seqlen or list(BIAS_SEQLENS)
    dtypes = args.dtype or list(BIAS_DTYPES)
    env, why = (None, "--no-torch") if args.no_torch else bench.torch_env()
    flex = None
    if env is None:
        report["notes"].append(f"SDPA and FlexAttention columns skipped: {why}")
    else:
        flex, why = flex_env(env, None)
        if flex is None:
            report["notes"].append(f"FlexAttention columns skipped: {why}")
    report.update(config={
        "tokens": BIAS_TOKENS, "head_dims": head_dims, "seqlens": seqlens, "dtypes": dtypes, "causal": False,
        "nheads": "2048 / head_dim", "cases": list(CASES),
        "bias_shapes": {n: str(BIAS_SHAPES[n]("B", "H", "N")).replace("'", "") for n in BIAS_SHAPES},
        "sparse": {"block": SPARSE_BLOCK, "empty": SPARSE_EMPTY, "seed": SPARSE_SEED},
        "flops": "4 * batch * nheads * seqlen^2 * head_dim, x2.5 for the backward",
        "sdpa": "scaled_dot_product_attention(attn_mask=bias) under sdpa_kernel(CUDNN_ATTENTION / "
                "EFFICIENT_ATTENTION); bias a leaf that requires grad; (B, H, S, D) contiguous copies",
        "flex": "torch.compile(flex_attention with score_mod: score + bias[...]), dynamic=False; the sparse "
                "mask as a block mask",
        "bars": bar_rules()}, impls=[i for i in IMPLS if i == "ours" or env is not None], bar_checks=[], bars={})
    for dtype in dtypes:
        for head_dim in head_dims:
            for seqlen in seqlens:
                bias_point(cupy, env, flex, report, save, head_dim=head_dim, seqlen=seqlen, dtype=dtype,
                           reps=args.reps)
    judge_report(report)


def format_bias_table(report) -> str:
    """One row per (head_dim, seqlen, case): ours' ms and TFLOP/s, the bias stream's TB/s, ×SDPA, ×flex, bars."""
    rows = report["results"]
    lines = [f"bias: batch * seqlen {BIAS_TOKENS}, nheads 2048 / head_dim, non-causal; ms per call; TF = TFLOP/s "
             "(4*B*H*N*N*D, x2.5 bwd); TB/s = the bias stream over ours' time",
             f"x sdpa: the faster SDPA backend's time / ours (bar >= {SDPA_BAR:g}); x flex: flex's / ours "
             f"(bar >= {FLEX_BAR:g}); vs p: time / the plain call's (sparse bar <= {SPARSE_BAR:g}, forward)",
             f"{'D':>4}{'seqlen':>7} {'case':<7}|" + "".join(
                 f"{pas + ' ms':>9}{'TF':>6}{'TB/s':>6}{'x sdpa':>7}{'x flex':>7}{'vs p':>6} |" for pas in PASSES)
             + " bars"]
    for r in rows:
        bars = " ".join(f"{k[4:]}={r[k]}" for k in sorted(r) if k.startswith("bar_"))
        lines.append(f"{r['head_dim']:>4}{r['seqlen']:>7} {r['case']:<7}|" + "".join(
            cell(r.get(f"ours_{pas}_ms"), 9, ".3f") + cell(r.get(f"ours_{pas}_tflops"), 6, ".0f")
            + cell(r.get(f"ours_{pas}_stream_tbps"), 6, ".2f") + cell(r.get(f"ratio_{pas}_vs_sdpa"), 7, ".2f")
            + cell(r.get(f"ratio_{pas}_vs_flex"), 7, ".2f") + cell(r.get(f"time_{pas}_vs_plain"), 6, ".2f") + " |"
            for pas in PASSES) + f" {bars}")
    bars = report.get("bars") or {}
    lines.append("bars: " + (", ".join(f"{n} {s}" for s, n in bars.items()) if bars else "none judged"))
    return "\n".join(lines)


def plot_bias(report, path):
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = [r for r in report["results"] if r["case"] in BIAS_SHAPES]
    fig, axes = plt.subplots(1, len(PASSES), figsize=(max(6, len(rows) * 0.7), 4), squeeze=False)
    labels = [f"D{r['head_dim']} {r['seqlen']}\n{r['case']}" for r in rows]
    for ax, pas in zip(axes[0], PASSES):
        for j, impl in enumerate(IMPLS):
            values = [r.get(f"{impl}_{pas}_tflops") or 0 for r in rows]
            ax.bar([i + 0.2 * j for i in range(len(rows))], values, 0.2, label=impl)
        ax.set_xticks([i + 0.4 for i in range(len(rows))], labels, fontsize=6)
        ax.set(ylabel=f"{pas} TFLOP/s", title=f"bias {pas}")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)


SUITE = (run_bias, format_bias_table, plot_bias)

__all__ = ["SUITE", "ERROR", "OOM", "NOT_IMPLEMENTED"]
