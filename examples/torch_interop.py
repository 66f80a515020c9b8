"""A training step in PyTorch with cupyflash's attention, checked against torch's own.

A tiny model (one causal self-attention layer with grouped KV heads, then a
linear head) takes one SGD step twice from the same weights: once with
``cupyflash.torch.flash_attn_func`` and once with
``torch.nn.functional.scaled_dot_product_attention`` (math backend).  The
script prints the largest differences in the loss, the logits and every
gradient.  q, k and v are views into one packed projection (no copies).

On a GPU the model runs in bfloat16 (``--dtype float16`` for half); without one
it runs on the CPU in float32 through cupyflash's CPU path.

Run: python examples/torch_interop.py [--dtype bfloat16|float16]
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cupyflash.torch import flash_attn_func


class TinyAttentionModel(torch.nn.Module):
    def __init__(self, width=256, nheads=8, nheads_kv=2, classes=10):
        super().__init__()
        self.nheads, self.nheads_kv, self.head_dim = nheads, nheads_kv, width // nheads
        self.qkv = torch.nn.Linear(width, (nheads + 2 * nheads_kv) * self.head_dim, bias=False)
        self.proj = torch.nn.Linear(width, width, bias=False)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x, attention):
        batch, seqlen, _ = x.shape
        qkv = self.qkv(x).view(batch, seqlen, self.nheads + 2 * self.nheads_kv, self.head_dim)
        q = qkv[:, :, :self.nheads]  # (batch, seqlen, heads, head_dim) views, last stride 1
        k = qkv[:, :, self.nheads:self.nheads + self.nheads_kv]
        v = qkv[:, :, self.nheads + self.nheads_kv:]
        y = attention(q, k, v).reshape(batch, seqlen, -1)
        return self.head(x + self.proj(y))


def cupyflash_attention(q, k, v):
    return flash_attn_func(q, k, v, causal=True)


def torch_attention(q, k, v):
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True, enable_gqa=True)
    return out.transpose(1, 2)


def train_step(model, x, target, attention, lr=0.1):
    """One SGD step; returns the loss, the logits and the gradients (before the update)."""
    model.zero_grad()
    logits = model(x, attention)
    loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
    return loss.detach(), logits.detach(), grads


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="GPU dtype (the CPU runs float32)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32

    torch.manual_seed(0)
    model = TinyAttentionModel().to(device, dtype)
    x = torch.randn(4, 256, 256, device=device, dtype=dtype)
    target = torch.randint(0, 10, (4, 256), device=device)

    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    ours = train_step(model, x, target, cupyflash_attention)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])
    theirs = train_step(model, x, target, torch_attention)

    print(f"device {device}, dtype {dtype}, x {tuple(x.shape)}, "
          f"{model.nheads} query heads / {model.nheads_kv} KV heads of {model.head_dim}")
    print(f"loss: cupyflash {ours[0].item():.6f}, torch SDPA {theirs[0].item():.6f}")
    print(f"max |logits difference| = {(ours[1] - theirs[1]).abs().max().item():.3e}")
    for name in weights:
        diff = (ours[2][name].float() - theirs[2][name].float()).abs().max().item()
        scale = theirs[2][name].float().abs().max().item()
        print(f"max |grad {name} difference| = {diff:.3e}   (max |grad| {scale:.3e})")


if __name__ == "__main__":
    main()
