"""Forward + backward time of models with and without a retrofitted mask prior
(`retrofit.add_mask_prior`), side by side in one run: timm's ViT-Tiny, a GPT-2 small config (Hugging
Face) and an nn.TransformerEncoder. A model whose library is not installed is left out and named.

    python benchmarks/bench_retrofit.py                        # ViT-Tiny/16 at 224, GPT-2 small at 256 tokens, CPU
    python benchmarks/bench_retrofit.py --device cuda --amp    # bf16 autocast on a GPU
    python benchmarks/bench_retrofit.py --models gpt2 --tokens 1024 --full   # GPT-2's prior as a full N x N M
    python benchmarks/bench_retrofit.py --tiny                 # two-layer toys (what the test runs)

One step = forward and backward (gradients of every weight and M) on a fixed random batch; each
model, its twin with the prior, and the floor (that twin with every M frozen: the same path with a
constant float mask, no gradient for M) are timed in interleaved rounds (warm-up excluded), and the
table gives median ms/step and the ratio to the plain model. Ratios, not milliseconds, carry from
machine to machine. What M costs is the prior's ratio over the floor's; what reading a bias costs
the kernel is the floor's. GPT-2's prior is the library's default for a causal distance prior (a
relative M, one logit per head and distance) unless --full.
"""
import argparse
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
import maskprior_retrofit as retrofit  # noqa: E402
from bench_attention import interleaved  # noqa: E402


def vit(args):
    """timm's ViT-Tiny/16 (12 x 192, 3 heads; 197 tokens at 224), prior: the impulse pattern (self,
    up, right), m_off 10, the class token free."""
    import timm
    kw = dict(img_size=32, patch_size=8, depth=2) if args.tiny else dict(img_size=args.img_size)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kw)
    grid = model.patch_embed.grid_size
    x = torch.randn(args.batch_size or (4 if args.tiny else 32), 3, *model.patch_embed.img_size)
    pattern = mp.impulse_pattern(*grid, mp.IMPULSE_OFFSETS[:3], n_prefix=model.num_prefix_tokens)
    return (model, x, lambda m: retrofit.add_mask_prior(m, pattern, m_off=10.0),
            f"timm ViT-Tiny ({pattern.shape[-1]} tokens)")


def gpt2(args):
    """A GPT-2 small config (12 x 768, 12 heads, random weights), prior: the causal-distance
    (ALiBi-like) M."""
    import transformers as tf
    tf.logging.set_verbosity_error()
    t = 16 if args.tiny else args.tokens
    cfg = tf.GPT2Config(n_positions=max(t, 1024), attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
                        **(dict(n_layer=2, n_head=4, n_embd=32) if args.tiny else {}))
    model = tf.GPT2LMHeadModel(cfg)
    x = torch.randint(0, cfg.vocab_size, (args.batch_size or (2 if args.tiny else 4), t),
                      generator=torch.Generator().manual_seed(0))
    logits = mp.causal_distance_logits(t, cfg.n_head)
    param = "full" if args.full else "relative"
    name = (f"GPT-2 {'toy' if args.tiny else 'small'} ({t} tokens, {param} M"
            f"{', flex' if args.flex else ''})")
    return (model, x, lambda m: retrofit.add_mask_prior(m, logits=logits, param=param, flex=args.flex),
            name)


def encoder(args):
    """nn.TransformerEncoder, 4 x 128, 4 heads, 64 tokens; prior: a band of width 4."""
    dim, t, layers = (16, 8, 1) if args.tiny else (128, 64, 4)
    layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True,
                                       norm_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    x = torch.randn(args.batch_size or (4 if args.tiny else 32), t, dim,
                    generator=torch.Generator().manual_seed(0))
    return model, x, lambda m: retrofit.add_mask_prior(m, mp.banded_pattern(t, 4)), f"nn.TransformerEncoder ({t} tokens)"


MODELS = {"vit": vit, "gpt2": gpt2, "encoder": encoder}


def step_fn(model, x, args):
    def step():
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=args.amp):
            y = model(x)
            y = y if isinstance(y, torch.Tensor) else y[0]
            loss = y.float().square().mean()
        model.zero_grad(set_to_none=True)
        loss.backward()
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit,gpt2,encoder",
                   help="comma list of: " + ", ".join(MODELS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--img-size", type=int, default=224, help="ViT-Tiny input size")
    p.add_argument("--tokens", type=int, default=256, help="GPT-2 sequence length")
    p.add_argument("--full", action="store_true",
                   help="GPT-2's prior as a full N x N M (the default: by distance)")
    p.add_argument("--flex", action="store_true",
                   help="GPT-2's prior inside torch's flex_attention (CUDA)")
    p.add_argument("--batch-size", type=int, help="default: 32 (ViT, encoder), 4 (GPT-2)")
    p.add_argument("--tiny", action="store_true", help="two-layer toy models (a smoke run)")
    p.add_argument("--steps", type=int, default=3, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device = torch.device(args.device)
    print(f"device {device} | amp {args.amp} | torch {torch.__version__} | {args.rounds} rounds x "
          f"{args.steps} steps, median | forward + backward")
    print(f"{'model':<44}{'ms/step':>9}{'ratio':>8}")
    for key in args.models.split(","):
        try:
            made = [MODELS[key](args) for _ in range(2)]
        except ImportError as e:
            print(f"{key:<44}{'not run':>9}  ({e.name} is not installed)")
            continue
        made.append(MODELS[key](args))
        (plain, x, _, label), (with_prior, _, attach, _), (floor, _, _, _) = made
        for model in (with_prior, floor):
            model.load_state_dict(plain.state_dict())
            attach(model)
        for prior in mp.mask_priors(floor):
            prior.bias.requires_grad_(False)
        x = x.to(device)
        steps = {}
        for name, model in ((label, plain), ("  floor (M constant)", floor),
                            ("  + prior", with_prior)):
            model.to(device).train()
            steps[name] = step_fn(model, x, args)
            for _ in range(2):
                steps[name]()
        times = interleaved(steps, device, args.rounds, args.steps)
        base = times[label]
        for name, med in times.items():
            print(f"{name:<44}{1000 * med:>9.2f}{med / base:>8.3f}")


if __name__ == "__main__":
    main()
