"""A jitted training step in JAX with cupyflash's attention, checked against JAX's own.

A tiny model (one causal self-attention layer with grouped KV heads, then a
linear head) takes one SGD step, under ``jax.jit(jax.value_and_grad(...))``,
twice from the same weights: once with ``cupyflash.jax.flash_attention`` and
once with ``jax.nn.dot_product_attention``.  The script prints the largest
differences in the loss, the logits and every gradient.

On a GPU the model runs in bfloat16 (``--dtype float16`` for half); without one
it runs on the CPU in float32 through cupyflash's CPU path.  GPU memory: XLA
preallocation is turned off below so CuPy (which holds the backward's scratch)
has room.

Run: python examples/jax_interop.py [--dtype bfloat16|float16]
"""

import argparse
import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before JAX starts

import jax
import jax.numpy as jnp

from cupyflash.jax import flash_attention

WIDTH, NHEADS, NHEADS_KV, CLASSES = 256, 8, 2, 10
HEAD_DIM = WIDTH // NHEADS


def init(key, dtype):
    k1, k2, k3 = jax.random.split(key, 3)

    def dense(key, n_in, n_out):
        return (jax.random.normal(key, (n_in, n_out)) / n_in ** 0.5).astype(dtype)

    return {"qkv": dense(k1, WIDTH, (NHEADS + 2 * NHEADS_KV) * HEAD_DIM),
            "proj": dense(k2, WIDTH, WIDTH),
            "head": dense(k3, WIDTH, CLASSES)}


def model(params, x, attention):
    batch, seqlen, _ = x.shape
    qkv = (x @ params["qkv"]).reshape(batch, seqlen, NHEADS + 2 * NHEADS_KV, HEAD_DIM)
    q, k, v = jnp.split(qkv, [NHEADS, NHEADS + NHEADS_KV], axis=2)  # (batch, seqlen, heads, dim)
    y = attention(q, k, v).reshape(batch, seqlen, WIDTH)
    return (x + y @ params["proj"]) @ params["head"]


def cupyflash_attention(q, k, v):
    return flash_attention(q, k, v, causal=True)


def jax_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


def make_train_step(attention, lr=0.1):
    def loss_fn(params, x, target):
        logits = model(params, x, attention)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32))
        return -jnp.take_along_axis(logp, target[..., None], axis=-1).mean(), logits

    @jax.jit
    def step(params, x, target):
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x, target)
        new = jax.tree.map(lambda p, g: p - lr * g.astype(p.dtype), params, grads)
        return new, loss, logits, grads

    return step


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="GPU dtype (the CPU runs float32)")
    args = parser.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.dtype(args.dtype) if on_gpu else jnp.float32

    key_params, key_x, key_t = jax.random.split(jax.random.key(0), 3)
    params = init(key_params, dtype)
    x = jax.random.normal(key_x, (4, 256, WIDTH)).astype(dtype)
    target = jax.random.randint(key_t, (4, 256), 0, CLASSES)

    _, loss, logits, grads = make_train_step(cupyflash_attention)(params, x, target)
    _, ref_loss, ref_logits, ref_grads = make_train_step(jax_attention)(params, x, target)

    print(f"backend {jax.default_backend()}, dtype {jnp.dtype(dtype).name}, x {x.shape}, "
          f"{NHEADS} query heads / {NHEADS_KV} KV heads of {HEAD_DIM}")
    print(f"loss: cupyflash {float(loss):.6f}, jax.nn.dot_product_attention {float(ref_loss):.6f}")
    diff = jnp.abs(logits.astype(jnp.float32) - ref_logits.astype(jnp.float32)).max()
    print(f"max |logits difference| = {float(diff):.3e}")
    for name in params:
        g, r = grads[name].astype(jnp.float32), ref_grads[name].astype(jnp.float32)
        print(f"max |grad {name} difference| = {float(jnp.abs(g - r).max()):.3e}   "
              f"(max |grad| {float(jnp.abs(r).max()):.3e})")


if __name__ == "__main__":
    main()
