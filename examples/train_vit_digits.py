"""Train a small vision transformer on scikit-learn's digits, every backward written out.

The 8x8 digit images are cut into 4x4 patches (4 tokens plus a class token;
``--patch 2`` gives 16 + 1), embedded to width 64, and passed through two
pre-LayerNorm transformer blocks (4 heads of 16) and a linear head on the class
token.  Forward and backward of every layer (linear, LayerNorm, GELU,
residuals, softmax cross-entropy) are written out in NumPy/CuPy (``xp``);
attention runs through ``cupyflash.flash_attn_fwd`` / ``cupyflash.flash_attn_bwd``;
Adam updates the weights.  CuPy is used when a GPU is usable (attention in
float16, the rest in float32), NumPy otherwise; ``--device gpu`` without a
usable GPU exits 2 with the reason ``python -m cupyflash info`` gives.  A run
below the accuracy target exits 1.

``--rel-bias`` adds a learned relative-position bias per head to every
attention layer (Swin-style: one entry per (dy, dx) offset between patches on
the grid, plus three for the class token's pairs), gathered into a
``(1, heads, tokens, tokens)`` ``attn_bias`` that the batch shares; its
gradient comes from ``flash_attn_bwd(..., return_dbias=True)`` (summed over the
batch by cupyflash) and is scattered back into the table.  The run then also
trains the plain model on the same split and reports both accuracies.

``gradient_check()`` compares the whole model's backward with central finite
differences in float64.  cupyflash accumulates in float32 whatever the input
dtype, so the float64 check runs the attention through the dense float64
reference (``cupyflash.reference``, the same contract); a second comparison
measures how far the gradients move when cupyflash's attention is swapped in.

Setup and run::

    pip install -e ".[examples]"
    python examples/train_vit_digits.py                 # train, report held-out accuracy
    python examples/train_vit_digits.py --grad-check    # the finite-difference check
    python examples/train_vit_digits.py --device cpu --steps 300 --batch 64
    python examples/train_vit_digits.py --rel-bias      # with a learned relative-position bias
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

# The matrices here are 64 wide: BLAS threads cost more than they gain (2x
# slower seen on 2 busy cores).  Must precede the first import of numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import cupyflash  # noqa: E402
import cupyflash.cli  # noqa: E402
from cupyflash import reference  # noqa: E402

#: Held-out accuracy the full run must reach.
TARGET_ACCURACY = 0.95
#: Largest relative error the float64 finite-difference check accepts.
GRAD_CHECK_TOL = 1e-6


@dataclasses.dataclass(frozen=True)
class Config:
    patch: int = 4          # patch side: 4 (4 tokens; fast, 0.98) or 2 (16 tokens; slower, 0.93)
    dim: int = 64           # token width
    heads: int = 4          # attention heads; head_dim = dim // heads
    depth: int = 2          # transformer blocks
    mlp: int = 128          # hidden width of the MLP
    batch: int = 128
    steps: int = 500
    lr: float = 2e-3
    warmup: int = 30
    seed: int = 0
    rel_bias: bool = False  # a learned relative-position bias per head in every attention layer

    @property
    def tokens(self):
        return (8 // self.patch) ** 2 + 1  # patches plus the class token

    @property
    def head_dim(self):
        return self.dim // self.heads

    @property
    def grid(self):
        return 8 // self.patch  # patches per side

    @property
    def rel_entries(self):
        """Entries of the relative-position table: (2 grid - 1)^2 patch offsets, then the
        class token's pairs (class -> patch, patch -> class, class -> class)."""
        return (2 * self.grid - 1) ** 2 + 3


def relative_index(cfg):
    """``(tokens, tokens)`` int: the table entry of each (query, key) token pair (token 0
    is the class token, token 1 + r * grid + c the patch at row r, column c)."""
    n = cfg.grid
    rows, cols = np.divmod(np.arange(n * n), n)
    offsets = ((rows[:, None] - rows[None, :] + n - 1) * (2 * n - 1) + cols[:, None] - cols[None, :] + n - 1)
    index = np.empty((cfg.tokens, cfg.tokens), dtype=np.int64)
    index[1:, 1:] = offsets
    base = (2 * n - 1) ** 2
    index[0, 1:], index[1:, 0], index[0, 0] = base, base + 1, base + 2
    return index


def relative_gather(cfg, xp, dtype):
    """``(tokens * tokens, rel_entries)`` one-hot matrix ``G``: the bias of head h is
    ``table[h] @ G.T`` and the table's gradient ``dbias[h] @ G`` (a gather and its
    scatter-add as two matrix products, the same on NumPy and CuPy)."""
    index = relative_index(cfg).reshape(-1)
    onehot = np.zeros((index.size, cfg.rel_entries), dtype=dtype)
    onehot[np.arange(index.size), index] = 1
    return xp.asarray(onehot)


#: Default steps on each path (batch 128): both reach >= 95% held-out accuracy.
STEPS = {"cpu": 500, "gpu": 1000}


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------


def load_data(seed=0, test_fraction=0.2):
    """Digits as float32 in [0, 1]: ``(x_train, x_test, y_train, y_test)``, a stratified split.

    1797 images of 8x8; with ``test_fraction=0.2``, 1437 to train and 360 held out.
    """
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        fail("the digits data set comes from scikit-learn, which is not importable; install it "
             "with 'pip install -e \".[examples]\"' or 'pip install scikit-learn'")

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    return tuple(train_test_split(x, digits.target, test_size=test_fraction,
                                  stratify=digits.target, random_state=seed))


def patchify(images, patch):
    """(B, 8, 8) images -> (B, (8/patch)^2, patch*patch) patches, row-major."""
    b, n = images.shape[0], 8 // patch
    x = images.reshape(b, n, patch, n, patch).transpose(0, 1, 3, 2, 4)
    return x.reshape(b, n * n, patch * patch)


# ----------------------------------------------------------------------------
# Layers: forward returns (output, cache); backward takes (grad, cache)
# ----------------------------------------------------------------------------

LN_EPS = 1e-5
GELU_C = math.sqrt(2.0 / math.pi)  # tanh-approximation constant


def linear_fwd(x, w, b):
    return x @ w + b, x


def linear_bwd(dy, x, w):
    """(dx, dw, db) of ``y = x @ w + b``; leading dims of x are summed over for dw, db."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return dy @ w.T, x2.T @ dy2, dy2.sum(axis=0)


def layernorm_fwd(x, gamma, beta):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    rstd = 1.0 / ((centred * centred).mean(axis=-1, keepdims=True) + LN_EPS) ** 0.5
    xhat = centred * rstd
    return xhat * gamma + beta, (xhat, rstd)


def layernorm_bwd(dy, cache, gamma):
    xhat, rstd = cache
    dy2, xhat2 = dy.reshape(-1, dy.shape[-1]), xhat.reshape(-1, xhat.shape[-1])
    dgamma, dbeta = (dy2 * xhat2).sum(axis=0), dy2.sum(axis=0)
    dxhat = dy * gamma
    dx = rstd * (dxhat - dxhat.mean(axis=-1, keepdims=True)
                 - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, dgamma, dbeta


def gelu_fwd(x, xp):
    t = xp.tanh(GELU_C * (x + 0.044715 * (x * x * x)))
    return 0.5 * x * (1.0 + t), (x, t)


def gelu_bwd(dy, cache):
    x, t = cache
    return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * x * x))


def softmax_xent_fwd(logits, labels, xp):
    """Mean cross-entropy; returns ``(loss, probabilities)``."""
    shifted = logits - logits.max(axis=-1, keepdims=True)
    logp = shifted - xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
    rows = xp.arange(logits.shape[0])
    return -logp[rows, labels].mean(), xp.exp(logp)


def softmax_xent_bwd(probs, labels, xp):
    d = probs.copy()
    d[xp.arange(probs.shape[0]), labels] -= 1.0
    return d / probs.shape[0]


class FlashAttention:
    """Attention through cupyflash; float16 on the GPU (what its kernels take)."""

    def __init__(self, xp):
        self.low = xp.float16 if xp is not np else None

    def fwd(self, q, k, v, bias=None):
        """``bias``: None, or a ``(1, heads, tokens, tokens)`` float32 additive bias."""
        dtype = q.dtype
        if self.low is not None:
            q, k, v = (t.astype(self.low) for t in (q, k, v))
        extra = {} if bias is None else {"attn_bias": bias}
        out, lse = cupyflash.flash_attn_fwd(q, k, v, **extra)
        return out.astype(dtype, copy=False), (q, k, v, out, lse, dtype, bias)

    def bwd(self, dout, saved):
        """``(dq, dk, dv)``, and the bias's gradient when the forward had one."""
        q, k, v, out, lse, dtype, bias = saved
        extra = {} if bias is None else {"attn_bias": bias, "return_dbias": True}
        grads = cupyflash.flash_attn_bwd(dout.astype(q.dtype), q, k, v, out, lse, **extra)
        return tuple(g.astype(dtype, copy=False) for g in grads)


class ReferenceAttention:
    """The dense float64 reference attention (``cupyflash.reference``): NumPy only."""

    def fwd(self, q, k, v, bias=None):
        out, _ = reference.attention_fwd(q, k, v, attn_bias=bias)
        return out.astype(q.dtype), (q, k, v, bias)

    def bwd(self, dout, saved):
        q, k, v, bias = saved
        extra = {} if bias is None else {"attn_bias": bias, "return_dbias": True}
        return tuple(g.astype(dout.dtype) for g in reference.attention_bwd(dout, q, k, v, **extra))


def attention_block_fwd(x, p, i, cfg, attn, gather=None):
    """``x + proj(attention(LN(x)))`` for block ``i``; with ``gather`` (the relative-position
    one-hot matrix, :func:`relative_gather`) the attention adds block ``i``'s bias."""
    b, t, d = x.shape
    h, ln = layernorm_fwd(x, p[f"b{i}.ln1.g"], p[f"b{i}.ln1.b"])
    qkv, qkv_in = linear_fwd(h, p[f"b{i}.qkv.w"], p[f"b{i}.qkv.b"])
    qkv = qkv.reshape(b, t, 3, cfg.heads, cfg.head_dim)
    bias = None
    if gather is not None:  # (1, heads, t, t): one bias per head, shared by the batch
        bias = (p[f"b{i}.rel"] @ gather.T).reshape(1, cfg.heads, t, t).astype(x.dtype, copy=False)
    o, saved = attn.fwd(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias)  # strided views, read in place
    y, proj_in = linear_fwd(o.reshape(b, t, d), p[f"b{i}.proj.w"], p[f"b{i}.proj.b"])
    return x + y, (ln, qkv_in, saved, proj_in)


def attention_block_bwd(dx, cache, p, i, cfg, attn, grads, xp, gather=None):
    ln, qkv_in, saved, proj_in = cache
    b, t, d = dx.shape
    do, grads[f"b{i}.proj.w"], grads[f"b{i}.proj.b"] = linear_bwd(dx, proj_in, p[f"b{i}.proj.w"])
    dq, dk, dv, *dbias = attn.bwd(do.reshape(b, t, cfg.heads, cfg.head_dim), saved)
    if gather is not None:  # dbias (1, heads, t, t), summed over the batch -> the table's rows
        grads[f"b{i}.rel"] = dbias[0].reshape(cfg.heads, t * t).astype(gather.dtype, copy=False) @ gather
    dqkv = xp.stack([dq, dk, dv], axis=2).reshape(b, t, 3 * d)
    dh, grads[f"b{i}.qkv.w"], grads[f"b{i}.qkv.b"] = linear_bwd(dqkv, qkv_in, p[f"b{i}.qkv.w"])
    dln, grads[f"b{i}.ln1.g"], grads[f"b{i}.ln1.b"] = layernorm_bwd(dh, ln, p[f"b{i}.ln1.g"])
    return dx + dln  # the residual


def mlp_block_fwd(x, p, i, xp):
    h, ln = layernorm_fwd(x, p[f"b{i}.ln2.g"], p[f"b{i}.ln2.b"])
    a, fc1_in = linear_fwd(h, p[f"b{i}.fc1.w"], p[f"b{i}.fc1.b"])
    g, gelu = gelu_fwd(a, xp)
    y, fc2_in = linear_fwd(g, p[f"b{i}.fc2.w"], p[f"b{i}.fc2.b"])
    return x + y, (ln, fc1_in, gelu, fc2_in)


def mlp_block_bwd(dx, cache, p, i, grads):
    ln, fc1_in, gelu, fc2_in = cache
    dg, grads[f"b{i}.fc2.w"], grads[f"b{i}.fc2.b"] = linear_bwd(dx, fc2_in, p[f"b{i}.fc2.w"])
    da = gelu_bwd(dg, gelu)
    dh, grads[f"b{i}.fc1.w"], grads[f"b{i}.fc1.b"] = linear_bwd(da, fc1_in, p[f"b{i}.fc1.w"])
    dln, grads[f"b{i}.ln2.g"], grads[f"b{i}.ln2.b"] = layernorm_bwd(dh, ln, p[f"b{i}.ln2.g"])
    return dx + dln


# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------


def init_params(cfg, xp=np, dtype=np.float32):
    """Weights ~ N(0, 0.02) (the patch embedding N(0, 1/fan_in)), biases 0, LN gains 1."""
    rng = np.random.default_rng(cfg.seed)
    d, pd = cfg.dim, cfg.patch * cfg.patch

    def normal(*shape, std=0.02):
        return rng.normal(0.0, std, shape)

    p = {"embed.w": normal(pd, d, std=1 / math.sqrt(pd)), "embed.b": np.zeros(d),
         "cls": normal(1, 1, d), "pos": normal(1, cfg.tokens, d),
         "ln.g": np.ones(d), "ln.b": np.zeros(d),
         "head.w": normal(d, 10), "head.b": np.zeros(10)}
    for i in range(cfg.depth):
        p.update({
            f"b{i}.ln1.g": np.ones(d), f"b{i}.ln1.b": np.zeros(d),
            f"b{i}.qkv.w": normal(d, 3 * d), f"b{i}.qkv.b": np.zeros(3 * d),
            f"b{i}.proj.w": normal(d, d), f"b{i}.proj.b": np.zeros(d),
            f"b{i}.ln2.g": np.ones(d), f"b{i}.ln2.b": np.zeros(d),
            f"b{i}.fc1.w": normal(d, cfg.mlp), f"b{i}.fc1.b": np.zeros(cfg.mlp),
            f"b{i}.fc2.w": normal(cfg.mlp, d), f"b{i}.fc2.b": np.zeros(d),
        })
        if cfg.rel_bias:
            p[f"b{i}.rel"] = np.zeros((cfg.heads, cfg.rel_entries))
    return {name: xp.asarray(x.astype(dtype)) for name, x in p.items()}


def _gather(cfg, xp, p):
    return relative_gather(cfg, xp, p["embed.w"].dtype) if cfg.rel_bias else None


def forward(p, patches, cfg, attn, xp):
    """Logits (B, 10) and the cache for :func:`backward`."""
    b = patches.shape[0]
    gather = _gather(cfg, xp, p)
    tok, embed_in = linear_fwd(patches, p["embed.w"], p["embed.b"])
    x = xp.concatenate([xp.broadcast_to(p["cls"], (b, 1, cfg.dim)), tok], axis=1) + p["pos"]
    blocks = []
    for i in range(cfg.depth):
        x, c_attn = attention_block_fwd(x, p, i, cfg, attn, gather)
        x, c_mlp = mlp_block_fwd(x, p, i, xp)
        blocks.append((c_attn, c_mlp))
    h, ln = layernorm_fwd(x[:, 0], p["ln.g"], p["ln.b"])
    logits, head_in = linear_fwd(h, p["head.w"], p["head.b"])
    return logits, (embed_in, blocks, ln, head_in, x.shape)


def backward(dlogits, cache, p, cfg, attn, xp):
    """Gradients of every parameter, from the gradient of the logits."""
    embed_in, blocks, ln, head_in, x_shape = cache
    gather = _gather(cfg, xp, p)
    grads = {}
    dh, grads["head.w"], grads["head.b"] = linear_bwd(dlogits, head_in, p["head.w"])
    dcls, grads["ln.g"], grads["ln.b"] = layernorm_bwd(dh, ln, p["ln.g"])
    dx = xp.zeros(x_shape, dtype=dlogits.dtype)
    dx[:, 0] = dcls  # only the class token reaches the head
    for i in reversed(range(cfg.depth)):
        c_attn, c_mlp = blocks[i]
        dx = mlp_block_bwd(dx, c_mlp, p, i, grads)
        dx = attention_block_bwd(dx, c_attn, p, i, cfg, attn, grads, xp, gather)
    grads["pos"] = dx.sum(axis=0, keepdims=True)
    grads["cls"] = dx[:, :1].sum(axis=0, keepdims=True)
    _, grads["embed.w"], grads["embed.b"] = linear_bwd(dx[:, 1:], embed_in, p["embed.w"])
    return grads


def loss_and_grads(p, patches, labels, cfg, attn, xp):
    logits, cache = forward(p, patches, cfg, attn, xp)
    loss, probs = softmax_xent_fwd(logits, labels, xp)
    return loss, backward(softmax_xent_bwd(probs, labels, xp), cache, p, cfg, attn, xp)


class Adam:
    def __init__(self, params, xp, beta1=0.9, beta2=0.999, eps=1e-8):
        self.m = {k: xp.zeros_like(v) for k, v in params.items()}
        self.v = {k: xp.zeros_like(v) for k, v in params.items()}
        self.beta1, self.beta2, self.eps, self.t = beta1, beta2, eps, 0

    def step(self, params, grads, lr):
        self.t += 1
        c1, c2 = 1 - self.beta1 ** self.t, 1 - self.beta2 ** self.t
        for k, g in grads.items():
            self.m[k] *= self.beta1
            self.m[k] += (1 - self.beta1) * g
            self.v[k] *= self.beta2
            self.v[k] += (1 - self.beta2) * g * g
            params[k] -= lr * (self.m[k] / c1) / ((self.v[k] / c2) ** 0.5 + self.eps)


def learning_rate(step, cfg):
    """Linear warm-up, then cosine decay to 0."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * progress))


def accuracy(p, patches, labels, cfg, attn, xp):
    logits, _ = forward(p, patches, cfg, attn, xp)
    return float((logits.argmax(axis=-1) == labels).astype(xp.float32).mean())


def train(cfg, xp=np, log=None):
    """Train on the digits split; return a dict with the held-out accuracy and timings."""
    x_train, x_test, y_train, y_test = load_data(cfg.seed)
    to_dev = lambda a: xp.asarray(a)  # noqa: E731
    tr_x, te_x = to_dev(patchify(x_train, cfg.patch)), to_dev(patchify(x_test, cfg.patch))
    tr_y, te_y = to_dev(y_train), to_dev(y_test)
    attn = FlashAttention(xp)
    params = init_params(cfg, xp)
    opt = Adam(params, xp)
    rng = np.random.default_rng(cfg.seed + 1)
    order, pos = rng.permutation(len(y_train)), 0
    start = time.perf_counter()
    losses = []
    for step in range(cfg.steps):
        if pos + cfg.batch > len(order):
            order, pos = rng.permutation(len(y_train)), 0
        idx = to_dev(order[pos:pos + cfg.batch])
        pos += cfg.batch
        loss, grads = loss_and_grads(params, tr_x[idx], tr_y[idx], cfg, attn, xp)
        opt.step(params, grads, learning_rate(step, cfg))
        losses.append(float(loss))
        if log is not None and (step % 100 == 0 or step == cfg.steps - 1):
            log(f"step {step:5d}  loss {np.mean(losses[-20:]):.4f}  "
                f"lr {learning_rate(step, cfg):.2e}  {time.perf_counter() - start:6.1f} s")
    seconds = time.perf_counter() - start
    return dict(accuracy=accuracy(params, te_x, te_y, cfg, attn, xp),
                train_accuracy=accuracy(params, tr_x, tr_y, cfg, attn, xp),
                seconds=seconds, steps=cfg.steps, final_loss=float(np.mean(losses[-20:])),
                n_train=len(y_train), n_test=len(y_test))


# ----------------------------------------------------------------------------
# Gradient check (CPU, float64)
# ----------------------------------------------------------------------------

#: A tiny model for the check: 2x2 patches (17 tokens), 2 heads of 16, 2 blocks, with the
#: relative-position bias (its table's gradient through dbias).
CHECK_CONFIG = Config(patch=2, dim=32, heads=2, depth=2, mlp=24, batch=3, seed=1, rel_bias=True)


def _relative_error(a, b):
    """Norm-wise relative error ``|a - b| / max(|a|, |b|)``."""
    scale = max(np.linalg.norm(a), np.linalg.norm(b))
    return float(np.linalg.norm(a - b) / scale) if scale > 0 else 0.0


def gradient_check(cfg=CHECK_CONFIG, samples=4, eps=1e-5, seed=0):
    """The whole model's backward against central finite differences, in float64.

    For every parameter tensor, ``samples`` random coordinates; and the
    derivative along one random direction in the space of all parameters.

    Returns
    -------
    dict
        ``max_rel_error``: worst norm-wise relative error over the tensors and
        the direction (attention through the float64 reference);
        ``per_tensor``: that error per tensor; ``direction``: the directional one;
        ``flash_vs_reference``: relative difference of the whole gradient when
        cupyflash's attention (float32 accumulation) replaces the reference.
    """
    rng = np.random.default_rng(seed)
    x_train, _, y_train, _ = load_data(cfg.seed)
    patches = patchify(x_train[:cfg.batch], cfg.patch).astype(np.float64)
    labels = y_train[:cfg.batch]
    params = init_params(cfg, np, np.float64)
    # Move away from the initialisation (LN gains exactly 1, biases exactly 0).
    for name, x in params.items():
        x += rng.normal(0.0, 0.1, x.shape)
    ref = ReferenceAttention()

    def loss_at(p):
        logits, _ = forward(p, patches, cfg, ref, np)
        return float(softmax_xent_fwd(logits, labels, np)[0])

    _, grads = loss_and_grads(params, patches, labels, cfg, ref, np)
    per_tensor = {}
    for name, x in params.items():
        flat, g = x.reshape(-1), grads[name].reshape(-1)
        idx = rng.choice(flat.size, size=min(samples, flat.size), replace=False)
        fd = np.empty(len(idx))
        for j, i in enumerate(idx):
            old = flat[i]
            flat[i] = old + eps
            up = loss_at(params)
            flat[i] = old - eps
            down = loss_at(params)
            flat[i] = old
            fd[j] = (up - down) / (2 * eps)
        per_tensor[name] = _relative_error(fd, g[idx])

    direction = {name: rng.standard_normal(x.shape) for name, x in params.items()}
    norm = math.sqrt(sum(float((d * d).sum()) for d in direction.values()))
    direction = {name: d / norm for name, d in direction.items()}  # a unit step
    shifted = lambda s: {n: x + s * direction[n] for n, x in params.items()}  # noqa: E731
    fd_dir = (loss_at(shifted(eps)) - loss_at(shifted(-eps))) / (2 * eps)
    an_dir = sum(float((grads[n] * direction[n]).sum()) for n in params)
    dir_err = _relative_error(np.array([fd_dir]), np.array([an_dir]))

    _, flash_grads = loss_and_grads(params, patches, labels, cfg, FlashAttention(np), np)
    every = lambda gs: np.concatenate([gs[n].reshape(-1) for n in params])  # noqa: E731
    return dict(max_rel_error=max(max(per_tensor.values()), dir_err), per_tensor=per_tensor,
                direction=dir_err,
                flash_vs_reference=_relative_error(every(flash_grads), every(grads)))


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def fail(message):
    """End the script: ``train_vit_digits: error: MESSAGE`` on one line of stderr, status 2."""
    print(f"train_vit_digits: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def usable_gpu():
    """``(cupy, device name)`` when cupyflash can run on the GPU, else ``(None, why not)``:
    the reason ``python -m cupyflash info`` prints (``cupyflash.cli.usable_gpu``: no
    cupy, no NVIDIA driver, no device, or a device older than the kernels need)."""
    return cupyflash.cli.usable_gpu()


def choose_xp(device="auto"):
    """``(numpy or cupy, "cpu" or "gpu", description)``.

    ``--device gpu`` without a usable GPU ends the script with the reason and status 2.
    """
    if device == "cpu":
        return np, "cpu", "NumPy (CPU path, --device cpu)"
    cupy, name_or_reason = usable_gpu()
    if cupy is None:
        if device == "gpu":
            fail(f"--device gpu, but the GPU is not usable: {name_or_reason}")
        return np, "cpu", f"NumPy (CPU path; no usable GPU: {' '.join(name_or_reason.split())})"
    return cupy, "gpu", f"CuPy on {name_or_reason} (GPU path; attention in float16)"


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1; got {text}")
    return value


def _positive_float(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0; got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0; got {text}")
    return value


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Train a small ViT on scikit-learn's digits with explicit backward and "
                    "cupyflash attention.")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: the GPU when usable, else the CPU (default: %(default)s)")
    parser.add_argument("--steps", type=_positive_int,
                        help=f"training steps (default: {STEPS['cpu']} on the CPU, "
                             f"{STEPS['gpu']} on the GPU)")
    parser.add_argument("--batch", type=_positive_int, default=Config.batch)
    parser.add_argument("--lr", type=_positive_float, default=Config.lr)
    parser.add_argument("--depth", type=_positive_int, default=Config.depth)
    parser.add_argument("--patch", type=int, choices=(2, 4), default=Config.patch,
                        help="patch side: 4 (5 tokens, default) or 2 (17 tokens)")
    parser.add_argument("--head-dim", type=int, choices=(16, 32), default=16,
                        help="attention head size (width 64: 4 heads of 16 or 2 of 32)")
    parser.add_argument("--seed", type=int, default=Config.seed)
    parser.add_argument("--rel-bias", action="store_true",
                        help="add a learned relative-position bias per head (attn_bias, trained through "
                             "dbias); also trains the plain model and reports both")
    parser.add_argument("--grad-check", action="store_true",
                        help="run the float64 finite-difference gradient check and exit")
    args = parser.parse_args(argv)

    if args.grad_check:
        result = gradient_check()
        for name, err in result["per_tensor"].items():
            print(f"  {name:12s} relative error {err:.2e}")
        ok = result["max_rel_error"] < GRAD_CHECK_TOL
        print(f"directional derivative relative error {result['direction']:.2e}")
        print(f"max relative error {result['max_rel_error']:.2e} "
              f"[{'ok' if ok else 'FAIL'}: need < {GRAD_CHECK_TOL:g}]")
        print(f"gradient with cupyflash attention vs float64 reference attention: relative "
              f"difference {result['flash_vs_reference']:.2e} (cupyflash accumulates in float32)")
        return 0 if ok else 1

    xp, kind, where = choose_xp(args.device)
    cfg = Config(steps=STEPS[kind] if args.steps is None else args.steps, batch=args.batch, lr=args.lr,
                 depth=args.depth, heads=64 // args.head_dim, patch=args.patch,
                 seed=args.seed, rel_bias=args.rel_bias)
    print(f"device: {where}")
    print(f"ViT: {cfg.tokens} tokens ({cfg.patch}x{cfg.patch} patches + class), width {cfg.dim}, "
          f"{cfg.depth} blocks, {cfg.heads} heads of {cfg.head_dim}; batch {cfg.batch}, "
          f"{cfg.steps} steps of Adam")
    if kind == "gpu":
        train(dataclasses.replace(cfg, steps=2), xp)  # compiles the kernels before timing
    result = train(cfg, xp, log=print)
    ok = result["accuracy"] >= TARGET_ACCURACY
    label = "with the relative-position bias: " if cfg.rel_bias else ""
    print(f"{label}held-out accuracy {result['accuracy']:.4f} on {result['n_test']} images "
          f"(train {result['train_accuracy']:.4f}) after {result['seconds']:.1f} s "
          f"[{'ok' if ok else 'below'} target {TARGET_ACCURACY}]")
    if cfg.rel_bias:
        plain = train(dataclasses.replace(cfg, rel_bias=False), xp)
        print(f"the plain model (no bias), same split and steps: held-out accuracy {plain['accuracy']:.4f} "
              f"(train {plain['train_accuracy']:.4f}) after {plain['seconds']:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
