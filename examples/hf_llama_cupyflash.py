"""cupyflash as a Hugging Face ``transformers`` attention implementation.

Registers cupyflash as ``"cupyfa"`` with ``transformers.AttentionInterface``
and builds a small, randomly initialised Llama-style model from ``LlamaConfig``
(grouped KV heads; nothing is downloaded).  The same weights run with
``attn_implementation="sdpa"`` and ``"cupyfa"``, on a full batch and on a
left-padded one; the script prints the largest logit difference and the error
of each against a float32 ``sdpa`` run (over the real tokens), and fails
unless cupyflash's error is within 2x sdpa's own (plus a small floor), the
rule of ``cupyflash.testing``.  A backward pass through the model (padded)
checks that gradients flow through cupyflash too.

How transformers calls an attention function (5.x): ``fn(module, query, key,
value, attention_mask, scaling=..., dropout=..., **kwargs)`` with q/k/v in
(batch, heads, seqlen, head_dim) (k/v with the KV heads, not repeated) and
expects ``(attn_output, attn_weights)`` with attn_output in (batch, seqlen,
heads, head_dim).  cupyflash takes (batch, seqlen, heads, head_dim), so q/k/v
are transposed views (last stride still 1: no copies) and GQA is native.
The name must not contain "flash": transformers treats any such name as a
flash-attention build to import (``is_flash_attention_requested``).
Masks: the mask function registered alongside is transformers' own
``sdpa_mask``, which gives None when plain causal attention will do (no
padding) and otherwise the 4-D boolean mask ``(batch, 1, q_len, kv_len)``,
True = attend (often an ``expand()``ed view).  The attention function passes
it through cupyflash's ``attn_mask`` as it is (read in place, never
densified or copied); a float additive mask (``eager_mask``'s kind, or one a
caller builds) goes through ``attn_bias``.  The mask already holds the
causal pattern and the padding, so ``causal`` is off then.  Query rows that
see no key (left-padding positions) come out 0.

On a GPU the models run in bfloat16 (``--dtype float16`` for half); without one,
on the CPU in float32 through cupyflash's CPU path.

Run: python examples/hf_llama_cupyflash.py [--dtype bfloat16|float16] [--seqlen N]
"""

import argparse
import copy
import sys

import torch
from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from cupyflash.torch import flash_attn_func


def cupyflash_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                        **kwargs):
    """A transformers attention function backed by cupyflash."""
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        raise NotImplementedError("cupyflash attention: sliding windows and softcap are not "
                                  "supported")
    scores = {}
    causal = getattr(module, "is_causal", True)
    if attention_mask is not None:
        # (batch, 1, q_len, kv_len): broadcast over the heads by its size-1 dimension; a
        # longer kv_len (a static cache) is cut to the keys given, as transformers' sdpa does
        mask = attention_mask[:, :, :, : key.shape[-2]]
        scores["attn_mask" if mask.dtype == torch.bool else "attn_bias"] = mask
        causal = False  # the mask holds the causal pattern (and the padding)
    # Causal masks align bottom-right, as transformers' KV cache expects (decoding included).
    out = flash_attn_func(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                          dropout_p=dropout, softmax_scale=scaling, causal=causal, **scores)
    return out, None


NAME = "cupyfa"  # no "flash" in it: see the module docstring
AttentionInterface.register(NAME, cupyflash_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # None, or the 4-D bool mask


def build(config, state, implementation, device, dtype):
    model = LlamaForCausalLM(copy.deepcopy(config))  # the implementation is set on the config
    model.load_state_dict(state)
    model.set_attn_implementation(implementation)
    return model.to(device, dtype).eval()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                        help="GPU dtype (the CPU runs float32)")
    parser.add_argument("--seqlen", type=int, default=200, help="tokens per sequence (>= 4)")
    args = parser.parse_args(argv)
    if args.seqlen < 4:
        parser.error(f"--seqlen must be at least 4; got {args.seqlen}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if device == "cuda" else torch.float32

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                         max_position_embeddings=512)
    state = LlamaForCausalLM(config).state_dict()
    input_ids = torch.randint(0, config.vocab_size, (2, args.seqlen), device=device)
    # the second sequence left-padded by a quarter of its length (padding comes first, as
    # for batched generation): transformers' 4-D mask then reaches the attention function
    padding = torch.ones_like(input_ids)
    padding[1, : args.seqlen // 4] = 0

    reference = build(config, state, "sdpa", device, torch.float32)
    sdpa = build(config, state, "sdpa", device, dtype)
    ours = build(config, state, NAME, device, dtype)
    print(f"Llama-style model: {config.num_hidden_layers} layers, {config.num_attention_heads} "
          f"query heads / {config.num_key_value_heads} KV heads of "
          f"{config.hidden_size // config.num_attention_heads}; input {tuple(input_ids.shape)}; "
          f"{device}, {dtype}")
    ok = True
    for label, mask in (("full batch", None), ("left-padded", padding)):
        with torch.no_grad():
            ref_logits = reference(input_ids, attention_mask=mask).logits
            sdpa_logits = sdpa(input_ids, attention_mask=mask).logits.float()
            our_logits = ours(input_ids, attention_mask=mask).logits.float()
        real = slice(None) if mask is None else mask.bool()  # padding positions are not compared
        ref_logits, sdpa_logits, our_logits = (x[real] for x in (ref_logits, sdpa_logits, our_logits))
        sdpa_err = (sdpa_logits - ref_logits).abs().max().item()
        our_err = (our_logits - ref_logits).abs().max().item()
        bound = 2 * sdpa_err + 1e-5 * max(1.0, ref_logits.abs().max().item())
        ok &= our_err <= bound and bool(torch.isfinite(our_logits).all())
        print(f"{label}:")
        print(f"  max |logits cupyflash - sdpa|        = {(our_logits - sdpa_logits).abs().max():.3e}")
        print(f"  max |logits sdpa - float32 sdpa|     = {sdpa_err:.3e}")
        print(f"  max |logits cupyflash - float32 sdpa| = {our_err:.3e}  (bound {bound:.3e})")

    labels = input_ids.masked_fill(padding == 0, -100)  # no loss on the padding
    loss = ours(input_ids, attention_mask=padding, labels=labels).loss
    loss.backward()
    grad = ours.model.layers[0].self_attn.q_proj.weight.grad
    print(f"loss {loss.item():.4f}; layer-0 q_proj grad norm {grad.float().norm().item():.4e}")
    if not ok or not torch.isfinite(grad).all():
        print("FAILED: cupyflash's logits are further from float32 than 2x sdpa's, or the "
              "gradient is not finite", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
