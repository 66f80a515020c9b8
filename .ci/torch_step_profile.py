"""Where a torch training step's host time goes (kernels_cu/PERF.md v15, run 31).

On the GPU machine: ``PYTHONPATH=. python3 .ci/torch_step_profile.py``. Prints the wall
µs per ``torch.autograd.grad`` step (B8 S128 H12 D64 bf16 causal) through
``flash_attn_func``, ``FlashAttnFunc.apply``, two do-nothing ``autograd.Function``s
with the same six inputs (saving five tensors, and none: torch's own floor), the
forward alone, and SDPA's FA2 through (B, S, H, D) views; then a cProfile of the
``flash_attn_func`` step.
"""
import cProfile, io, pstats, time
import torch
import cupyflash
from cupyflash.torch import flash_attn_func, FlashAttnFunc
from torch.nn.attention import SDPBackend, sdpa_kernel

B, S, H, D = 8, 128, 12, 64
q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
q, k, v = (x.requires_grad_() for x in (q, k, v))

def wall_us(fn, n=500):
    for _ in range(30): fn()
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(n): fn()
    torch.cuda.synchronize(); return (time.perf_counter() - t0) / n * 1e6

pre = [torch.empty_like(x) for x in (q, k, v)]
class Dummy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s, c, d):
        out = torch.empty_like(q); lse = torch.empty(B, H, S, device="cuda")
        ctx.save_for_backward(q, k, v, out, lse)
        return out
    @staticmethod
    def backward(ctx, g):
        ctx.saved_tensors
        return pre[0], pre[1], pre[2], None, None, None
class DummyNoSave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, s, c, d):
        return torch.empty_like(q)
    @staticmethod
    def backward(ctx, g):
        return pre[0], pre[1], pre[2], None, None, None

steps = {
  "flash_attn_func step": lambda: torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do),
  "FlashAttnFunc.apply step": lambda: torch.autograd.grad(FlashAttnFunc.apply(q, k, v, 0.125, True, False), (q, k, v), do),
  "dummy Function (save 5) step": lambda: torch.autograd.grad(Dummy.apply(q, k, v, 0.125, True, False), (q, k, v), do),
  "dummy Function (no save) step": lambda: torch.autograd.grad(DummyNoSave.apply(q, k, v, 0.125, True, False), (q, k, v), do),
  "flash_attn_func fwd only": lambda: flash_attn_func(q, k, v, causal=True),
}
qt, kt, vt, dot = (x.transpose(1, 2) for x in (q, k, v, do))
def sdpa():
    o = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
    return torch.autograd.grad(o, (q, k, v), dot)
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    steps["sdpa fa2 step"] = sdpa
    for name, fn in steps.items():
        print(f"{name:34s} {wall_us(fn):8.1f} us")
pr = cProfile.Profile(); pr.enable()
for _ in range(1000):
    torch.autograd.grad(flash_attn_func(q, k, v, causal=True), (q, k, v), do)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25); print(s.getvalue()[-5000:])
