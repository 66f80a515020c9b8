"""Serve several prompts at once from a paged KV cache: a small Llama-style decoder.

A 2-layer decoder with random weights from ``--seed`` (nothing downloaded):
vocabulary 64, width 128, RMSNorm, rotary position embeddings (RoPE), grouped-
query attention (8 query heads, 2 KV heads, head_dim 16) and a SwiGLU MLP,
written once for NumPy and CuPy (``xp``).  ``--prompts N`` random prompts of
different lengths are served with continuous batching: at most ``--max-batch``
sequences are active; each has its own budget of new tokens (up to
``--max-new-tokens``), so they finish at different times, and a waiting prompt
joins the batch as soon as one finishes.

The KV cache is paged, as in vLLM: each layer has a pool of blocks of 16 slots
(``(num_blocks, 16, 2, 16)`` keys and values), handed out from a shuffled free
list as sequences grow and returned when they finish, so later prompts reuse
freed blocks in whatever physical order.  Each sequence's ``block_table`` row
lists its blocks.  A new prompt is prefilled through
``cupyflash.flash_attn_with_kvcache`` (its keys appended, causal, in chunks of
``--prefill-chunk`` tokens); then every step decodes one token greedily for all
active sequences in one batched call per layer.

``--check`` (the default) recomputes every step without the cache: the same
model on each whole token sequence with dense causal attention
(``cupyflash.flash_attn_fwd(..., causal=True)``), and requires the logits to
agree within ``TOLERANCE`` (max abs difference); the run exits 1 otherwise.
It prints tokens/s of the cached path (prefill and decode, the checks not
timed) and, when torch is installed, of the same model and cache with the
attention through torch's ``scaled_dot_product_attention`` on the CPU.

CuPy is used when a GPU is usable, NumPy otherwise (``--device cpu|gpu`` forces
one; ``--device gpu`` without a usable GPU exits 2 with the reason ``python -m
cupyflash info`` gives).  On CuPy, ``flash_attn_with_kvcache`` runs cupyflash's
decode kernel (kernels_cu/flash_decode.cu) on the paged cache.

Run::

    pip install -e .
    python examples/generate.py                       # 8 prompts, batch of 4, checked
    python examples/generate.py --prompts 16 --max-batch 6 --max-new-tokens 48
    python examples/generate.py --no-check            # just the cached path, timed
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

# The matrices here are at most 128 x 256: BLAS threads cost more than they gain.
# Must precede the first import of numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import cupyflash  # noqa: E402
import cupyflash.cli  # noqa: E402

#: Largest max abs difference between the cached and the recomputed logits
#: (float32 on the CPU: the two paths differ by ~1e-6 on logits of size ~1).
TOLERANCE = {"cpu": 1e-4, "gpu": 3e-2}  # gpu: float16 attention


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 64
    dim: int = 128          # model width = heads * head_dim
    heads: int = 8          # query heads
    kv_heads: int = 2       # key/value heads (GQA: 4 query heads share one)
    head_dim: int = 16
    hidden: int = 256       # SwiGLU hidden width
    layers: int = 2
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    page_size: int = 16
    seed: int = 0


# ----------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------


def init_params(cfg, xp=np):
    """Random float32 weights, N(0, 1/fan_in) (embeddings N(0, 1)), RMSNorm gains near 1."""
    rng = np.random.default_rng(cfg.seed)
    d, qd, kvd = cfg.dim, cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim

    def w(fan_in, fan_out):
        return rng.normal(0.0, 1.0 / math.sqrt(fan_in), (fan_in, fan_out))

    def gain():
        return 1.0 + rng.normal(0.0, 0.1, d)

    p = {"embed": rng.normal(0.0, 1.0, (cfg.vocab, d)), "norm": gain(), "head": w(d, cfg.vocab)}
    for i in range(cfg.layers):
        p.update({f"l{i}.attn_norm": gain(), f"l{i}.wq": w(d, qd), f"l{i}.wk": w(d, kvd),
                  f"l{i}.wv": w(d, kvd), f"l{i}.wo": w(qd, d), f"l{i}.mlp_norm": gain(),
                  f"l{i}.gate": w(d, cfg.hidden), f"l{i}.up": w(d, cfg.hidden),
                  f"l{i}.down": w(cfg.hidden, d)})
    return {name: xp.asarray(x.astype(np.float32)) for name, x in p.items()}


def rms_norm(x, gain, eps):
    return x / ((x * x).mean(axis=-1, keepdims=True) + eps) ** 0.5 * gain


def rope(x, positions, theta, xp):
    """Rotate ``x`` (batch, seqlen, heads, head_dim) at ``positions`` (batch, seqlen):
    the pairs (i, i + head_dim/2), as Llama does."""
    half = x.shape[-1] // 2
    freqs = theta ** (-xp.arange(half, dtype=xp.float32) / half)
    angles = positions[..., None].astype(xp.float32) * freqs  # (batch, seqlen, half)
    cos, sin = xp.cos(angles)[:, :, None], xp.sin(angles)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return xp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def silu(x, xp):
    return x / (1.0 + xp.exp(-x))


def forward(p, tokens, positions, cfg, attend, xp):
    """Logits (batch, seqlen, vocab) of ``tokens`` (batch, seqlen) at ``positions``.

    ``attend(layer, q, k, v)`` does the attention: q (batch, seqlen, heads,
    head_dim) after RoPE, k and v (batch, seqlen, kv_heads, head_dim): the new
    tokens' keys and values (with a cache, it appends them and attends to all).
    """
    b, t = tokens.shape
    x = p["embed"][tokens]
    for i in range(cfg.layers):
        h = rms_norm(x, p[f"l{i}.attn_norm"], cfg.norm_eps)
        q = (h @ p[f"l{i}.wq"]).reshape(b, t, cfg.heads, cfg.head_dim)
        k = (h @ p[f"l{i}.wk"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        v = (h @ p[f"l{i}.wv"]).reshape(b, t, cfg.kv_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg.rope_theta, xp), rope(k, positions, cfg.rope_theta, xp)
        o = attend(i, q, k, v)
        x = x + o.reshape(b, t, -1) @ p[f"l{i}.wo"]
        h = rms_norm(x, p[f"l{i}.mlp_norm"], cfg.norm_eps)
        x = x + (silu(h @ p[f"l{i}.gate"], xp) * (h @ p[f"l{i}.up"])) @ p[f"l{i}.down"]
    return rms_norm(x, p["norm"], cfg.norm_eps) @ p["head"]


def dense_logits(p, tokens, cfg, xp, low=None):
    """The recomputation without a cache: the whole sequence, dense causal attention."""
    tokens = xp.asarray(np.asarray(tokens, dtype=np.int64))[None]
    positions = xp.arange(tokens.shape[1])[None]

    def attend(layer, q, k, v):
        dtype = q.dtype
        if low is not None:
            q, k, v = (a.astype(low) for a in (q, k, v))
        out, _ = cupyflash.flash_attn_fwd(q, k, v, causal=True)
        return out.astype(dtype, copy=False)

    return forward(p, tokens, positions, cfg, attend, xp)[0]


# ----------------------------------------------------------------------------
# The paged KV cache
# ----------------------------------------------------------------------------


class Sequence:
    """One request: its prompt, budget of new tokens, tokens so far and cache blocks."""

    def __init__(self, index, prompt, budget):
        self.index, self.prompt, self.budget = index, list(prompt), budget
        self.tokens = list(prompt)
        self.length = 0       # tokens whose keys are in the cache
        self.blocks = []      # physical block ids, in logical order
        self.finished_at = None  # the decode step count when it finished

    @property
    def generated(self):
        return self.tokens[len(self.prompt):]

    @property
    def done(self):
        return len(self.generated) >= self.budget


class PagedKVCache:
    """Per layer a pool of ``num_blocks`` blocks of ``page_size`` slots, and a free list.

    The free list starts shuffled (the physical order of a sequence's blocks is
    arbitrary); ``grow`` takes blocks from it, ``release`` gives them back.
    ``reused`` counts the allocations of a block that an earlier sequence freed.
    """

    def __init__(self, cfg, num_blocks, xp, dtype, rng):
        shape = (num_blocks, cfg.page_size, cfg.kv_heads, cfg.head_dim)
        self.k = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.layers)]
        self.v = [xp.zeros(shape, dtype=dtype) for _ in range(cfg.layers)]
        self.page_size, self.num_blocks, self.xp = cfg.page_size, num_blocks, xp
        self.free = [int(i) for i in rng.permutation(num_blocks)]
        self.freed = set()
        self.allocated = self.reused = 0

    def grow(self, seq, length):
        """Give ``seq`` enough blocks for ``length`` tokens."""
        while len(seq.blocks) * self.page_size < length:
            if not self.free:
                raise RuntimeError("the block pool is exhausted")  # sized so that it never is
            block = self.free.pop()
            self.allocated += 1
            self.reused += block in self.freed
            seq.blocks.append(block)

    def release(self, seq):
        self.free.extend(reversed(seq.blocks))
        self.freed.update(seq.blocks)
        seq.blocks = []

    def block_table(self, seqs):
        """The int32 (batch, max_blocks) table of ``seqs`` (unused entries 0), on the host."""
        width = max(len(s.blocks) for s in seqs)
        table = np.zeros((len(seqs), width), dtype=np.int32)
        for row, s in enumerate(seqs):
            table[row, :len(s.blocks)] = s.blocks
        return table


def cupyflash_attention(cache, layer, q, k, v, lengths, table):
    """Append k, v at ``lengths`` and attend: ``cupyflash.flash_attn_with_kvcache``."""
    return cupyflash.flash_attn_with_kvcache(q, cache.k[layer], cache.v[layer], k, v,
                                             cache_seqlens=lengths, block_table=table, causal=True)


def torch_sdpa_attention(cache, layer, q, k, v, lengths, table):
    """The same append into the same NumPy cache, then torch SDPA per sequence (CPU)."""
    import torch
    import torch.nn.functional as F

    kc, vc, page = cache.k[layer], cache.v[layer], cache.page_size
    out = np.empty_like(q)
    new = q.shape[1]
    for b in range(q.shape[0]):
        start = int(lengths[b])
        pos = np.arange(start, start + new)
        kc[table[b, pos // page], pos % page] = k[b]
        vc[table[b, pos // page], pos % page] = v[b]
        total = start + new
        pages = table[b, :-(-total // page)]
        keys = kc[pages].reshape(-1, *kc.shape[2:])[:total]
        values = vc[pages].reshape(-1, *vc.shape[2:])[:total]
        tq, tk, tv = (torch.from_numpy(np.ascontiguousarray(a)).transpose(0, 1)
                      for a in (q[b], keys, values))  # (heads, len, head_dim)
        rep = tq.shape[0] // tk.shape[0]
        tk, tv = tk.repeat_interleave(rep, dim=0), tv.repeat_interleave(rep, dim=0)
        mask = torch.ones(new, total, dtype=torch.bool).tril(diagonal=total - new)
        out[b] = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask).transpose(0, 1).numpy()
    return out


# ----------------------------------------------------------------------------
# Serving
# ----------------------------------------------------------------------------


def make_requests(n, max_new_tokens, seed, vocab, min_prompt=3, max_prompt=40):
    """``n`` random prompts of different lengths and budgets in [max_new/3, max_new]."""
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(min_prompt, max_prompt + 1, size=n)
    budgets = rng.integers(max(1, max_new_tokens // 3), max_new_tokens + 1, size=n)
    return [Sequence(i, rng.integers(0, vocab, size=int(L)), int(m))
            for i, (L, m) in enumerate(zip(lengths, budgets))]


class Server:
    """Continuous batching over a paged cache; ``step()`` advances every active sequence."""

    def __init__(self, p, cfg, requests, max_batch, xp, attention=cupyflash_attention,
                 prefill_chunk=32, low=None, check=True):
        self.p, self.cfg, self.xp, self.attention, self.low = p, cfg, xp, attention, low
        self.waiting, self.active, self.finished = list(requests), [], []
        self.max_batch, self.prefill_chunk, self.check = max_batch, prefill_chunk, check
        longest = max(len(s.prompt) + s.budget for s in requests)
        per_seq = -(-longest // cfg.page_size)
        self.cache = PagedKVCache(cfg, max_batch * per_seq, xp,
                                  np.float32 if low is None else low,
                                  np.random.default_rng(cfg.seed + 2))
        self.seconds = 0.0          # time in the cached path
        self.steps = 0
        self.max_diff = 0.0
        self.checks = 0
        self.joined_later = 0       # prompts admitted after another sequence finished
        self.log = []               # (step, event) lines

    # the cached forward ---------------------------------------------------

    def _cached_logits(self, seqs, tokens, new):
        """Logits of ``new`` tokens (batch, new) appended to each of ``seqs``."""
        xp = self.xp
        for s in seqs:
            self.cache.grow(s, s.length + new)
        lengths = np.array([s.length for s in seqs], dtype=np.int32)
        table = xp.asarray(self.cache.block_table(seqs))
        lengths_x = xp.asarray(lengths)
        positions = xp.asarray(lengths[:, None].astype(np.int64) + np.arange(new))

        def attend(layer, q, k, v):
            dtype = q.dtype
            if self.low is not None:
                q, k, v = (a.astype(self.low) for a in (q, k, v))
            out = self.attention(self.cache, layer, q, k, v, lengths_x, table)
            return out.astype(dtype, copy=False)

        logits = forward(self.p, xp.asarray(np.asarray(tokens, dtype=np.int64)), positions,
                         self.cfg, attend, xp)
        for s in seqs:
            s.length += new
        return _host(logits, xp)

    def _verify(self, s, logits):
        """Compare ``logits`` (n, vocab) with the last n rows of the dense recomputation."""
        if not self.check:
            return
        full = _host(dense_logits(self.p, s.tokens[:s.length], self.cfg, self.xp, self.low), self.xp)
        diff = float(np.abs(full[-len(logits):] - logits).max())
        self.max_diff = max(self.max_diff, diff)
        self.checks += 1

    def _admit(self):
        while self.waiting and len(self.active) < self.max_batch:
            s = self.waiting.pop(0)
            if self.finished:
                self.joined_later += 1
            start = time.perf_counter()
            chunks = []
            for lo in range(0, len(s.prompt), self.prefill_chunk):
                chunk = s.prompt[lo:lo + self.prefill_chunk]
                chunks.append(self._cached_logits([s], [chunk], len(chunk))[0])
            logits = np.concatenate(chunks)
            s.tokens.append(int(logits[-1].argmax()))
            self.seconds += time.perf_counter() - start
            self._verify(s, logits)
            self.log.append((self.steps, f"prompt {s.index} ({len(s.prompt)} tokens) joins "
                                         f"with blocks {s.blocks}"))
            self.active.append(s)

    def _retire(self):
        for s in [s for s in self.active if s.done]:
            self.active.remove(s)
            self.cache.release(s)
            self.finished.append(s)
            s.finished_at = self.steps
            self.log.append((self.steps, f"prompt {s.index} finished after {len(s.generated)} "
                                         f"new tokens; blocks freed"))

    def step(self):
        """Admit waiting prompts, decode one token for every active sequence, retire the done."""
        self._retire()
        while self.waiting and len(self.active) < self.max_batch:
            self._admit()
            self._retire()  # a budget of 1 is spent by the prefill
        if not self.active:
            return False
        seqs = list(self.active)
        start = time.perf_counter()
        logits = self._cached_logits(seqs, [[s.tokens[-1]] for s in seqs], 1)[:, 0]
        for s, row in zip(seqs, logits):
            s.tokens.append(int(row.argmax()))
        self.seconds += time.perf_counter() - start
        self.steps += 1
        for s, row in zip(seqs, logits):
            self._verify(s, row[None])
        return True

    def run(self):
        while self.step():
            pass
        self._retire()
        return self

    @property
    def generated_tokens(self):
        return sum(len(s.generated) for s in self.finished)


def _host(a, xp):
    return a if xp is np else xp.asnumpy(a)


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def fail(message):
    """End the script: ``generate: error: MESSAGE`` on one line of stderr, status 2."""
    print(f"generate: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def usable_gpu():
    """``(cupy, device name)`` when cupyflash can run on the GPU, else ``(None, why not)``
    (``cupyflash.cli.usable_gpu``: the reason ``python -m cupyflash info`` prints)."""
    return cupyflash.cli.usable_gpu()


def choose_xp(device="auto"):
    """``(numpy or cupy, "cpu" or "gpu", description)``.

    ``--device gpu`` without a usable GPU ends the script with the reason and
    status 2.
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


def serve(cfg, n_prompts, max_new_tokens, max_batch, xp=np, check=True, prefill_chunk=32,
          attention=cupyflash_attention, low=None):
    """Run the whole workload; the :class:`Server` after it."""
    p = init_params(cfg, xp)
    requests = make_requests(n_prompts, max_new_tokens, cfg.seed, cfg.vocab)
    return Server(p, cfg, requests, max_batch, xp, attention=attention,
                  prefill_chunk=prefill_chunk, low=low, check=check).run()


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Greedy generation for several prompts with continuous batching over a "
                    "paged KV cache (cupyflash.flash_attn_with_kvcache), checked against a "
                    "recomputation without the cache.")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: the GPU when usable, else the CPU (default: %(default)s)")
    parser.add_argument("--prompts", type=_positive_int, default=8,
                        help="prompts to serve (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=_positive_int, default=32,
                        help="largest budget of new tokens; each prompt gets one between a third "
                             "of it and it (default: %(default)s)")
    parser.add_argument("--max-batch", type=_positive_int, default=4,
                        help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=_positive_int, default=32,
                        help="prompt tokens per prefill call (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="compare every step's logits with a recomputation without the cache "
                             "(default: on)")
    args = parser.parse_args(argv)

    xp, kind, where = choose_xp(args.device)
    low = None if xp is np else xp.float16
    cfg = Config(seed=args.seed)
    print(f"device: {where}")
    print(f"model: {cfg.layers} layers, width {cfg.dim}, {cfg.heads} query heads / "
          f"{cfg.kv_heads} KV heads of {cfg.head_dim}, SwiGLU {cfg.hidden}, vocabulary "
          f"{cfg.vocab}, random weights (seed {cfg.seed})")
    server = serve(cfg, args.prompts, args.max_new_tokens, args.max_batch, xp, args.check,
                   args.prefill_chunk, low=low)
    for step, event in server.log:
        print(f"  step {step:3d}: {event}")
    cache = server.cache
    print(f"paged cache: {cache.num_blocks} blocks of {cfg.page_size} per layer; "
          f"{cache.allocated} allocations, {cache.reused} of them reusing a freed block; "
          f"{server.joined_later} prompts joined after another finished")
    for s in sorted(server.finished, key=lambda s: s.index):
        print(f"  prompt {s.index}: {len(s.prompt):2d} tokens -> {' '.join(map(str, s.generated))}")
    tokens = server.generated_tokens
    print(f"cached path (cupyflash.flash_attn_with_kvcache): {tokens} new tokens in "
          f"{server.steps} decode steps, {server.seconds:.3f} s: {tokens / server.seconds:.0f} tokens/s")
    if xp is np:
        try:
            import torch  # noqa: F401
        except ImportError:
            torch = None
        if torch is not None:
            other = serve(cfg, args.prompts, args.max_new_tokens, args.max_batch, np, False,
                          args.prefill_chunk, attention=torch_sdpa_attention)
            same = ([s.generated for s in sorted(other.finished, key=lambda s: s.index)]
                    == [s.generated for s in sorted(server.finished, key=lambda s: s.index)])
            print(f"same model, attention through torch SDPA (CPU): "
                  f"{other.generated_tokens / other.seconds:.0f} tokens/s "
                  f"({'same' if same else 'different'} tokens)")
    if not args.check:
        return 0
    tol = TOLERANCE[kind]
    ok = server.max_diff < tol
    print(f"check: the logits of {server.checks} tokens (each prefill's and every decode step's) vs "
          f"the recomputation without the cache: max abs "
          f"difference {server.max_diff:.2e} [{'ok' if ok else 'FAIL'}: need < {tol:g}]")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
