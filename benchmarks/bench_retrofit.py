"""Forward + backward time of models with and without a retrofitted mask prior (`retrofit.add_mask_prior`), side by
side in one run: timm's ViT-Tiny, a GPT-2 small config (Hugging Face) and an nn.TransformerEncoder. A model whose
library is not installed is left out and named.

    python benchmarks/bench_retrofit.py                        # ViT-Tiny/16 at 224, GPT-2 small at 256 tokens, CPU
    python benchmarks/bench_retrofit.py --device cuda --amp    # bf16 autocast on a GPU
    python benchmarks/bench_retrofit.py --models gpt2 --tokens 1024 --full   # GPT-2's prior as a full N x N M
    python benchmarks/bench_retrofit.py --models vit --grid    # the ViT's as a 2-D relative M (param="grid")
    python benchmarks/bench_retrofit.py --tiny                 # two-layer toys (what the test runs)

One step = forward and backward (gradients of every weight and M) on a fixed random batch; each model, its twin with
the prior, and the floor (that twin with every M frozen: the prior's bias, a constant, through the model's own
attention call, no gradient for M) are timed in interleaved rounds (warm-up excluded). The table (stdout) gives
median ms/step and the ratio to the plain model: the median of the per-round ratios (a row's time over the plain
model's in the same round) and their min-max, which tells noise from signal. Ratios, not milliseconds, carry from
machine to machine. What M costs is the prior's ratio over the floor's (printed on stderr for each model, beside the
progress, what runs each model's attention, and the legend); what a fixed bias costs is the floor's. GPT-2's prior
is the library's default for a causal distance prior (a relative M, one logit per head and distance) unless --full.

The floor is a true floor: on the CPU it runs the prior's own call, or a faster one, and skips M's gradient (checked
with torch.profiler): timm's ViT hands the bias to SDPA as a 3-D attn_mask, which takes SDPA's math path with or
without a gradient; GPT-2's relative prior goes through `mp.prior_attention` (the fused kernel with the bias and
is_causal, then our own backward, which the floor runs without M's gradient); nn.MultiheadAttention (and GPT-2 with
--full) hands it to SDPA as attn_mask, where a mask that needs a gradient takes the math path and a constant one the
fused kernel, faster (one attention call of the encoder's size, batch 32, 4 heads, 64 tokens: 0.80x against 1.29x of
no mask). So a floor above the prior is noise, which the per-round min-max shows; the stderr notes say so when it
happens."""
import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import maskprior as mp  # noqa: E402
import maskprior_retrofit as retrofit  # noqa: E402
from bench_attention import round_ratios, timed_rounds  # noqa: E402


def vit(args):
    """timm's ViT-Tiny/16 (12 x 192, 3 heads; 197 tokens at 224), prior: the soft impulse (self, up, right: one bump
    a head, `soft_offset_logits`), m_off 10, the class token free; the same logits full or grid."""
    import timm
    kw = dict(img_size=32, patch_size=8, depth=2) if args.tiny else dict(img_size=args.img_size)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, **kw)
    grid = model.patch_embed.grid_size
    x = torch.randn(args.batch_size or (4 if args.tiny else 32), 3, *model.patch_embed.img_size)
    logits = mp.soft_offset_logits(*grid, mp.IMPULSE_OFFSETS[:3], 1.0, 5.0, 10.0, n_prefix=model.num_prefix_tokens)
    param = "grid" if args.grid else "full"
    return (model, x, lambda m: retrofit.add_mask_prior(m, logits=logits, param=param),
            f"timm ViT-Tiny ({logits.shape[-1]} tokens, {param} M)")


def gpt2(args):
    """A GPT-2 small config (12 x 768, 12 heads, random weights), prior: the causal-distance (ALiBi-like) M."""
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
    name = f"GPT-2 {'toy' if args.tiny else 'small'} ({t} tokens, {param} M{', flex' if args.flex else ''})"
    return (model, x, lambda m: retrofit.add_mask_prior(m, logits=logits, param=param, flex=args.flex), name)


def encoder(args):
    """nn.TransformerEncoder, 4 x 128, 4 heads, 64 tokens; prior: a band of width 4."""
    dim, t, layers = (16, 8, 1) if args.tiny else (128, 64, 4)
    layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
    model = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    x = torch.randn(args.batch_size or (4 if args.tiny else 32), t, dim, generator=torch.Generator().manual_seed(0))
    return (model, x, lambda m: retrofit.add_mask_prior(m, mp.banded_pattern(t, 4)),
            f"nn.TransformerEncoder ({t} tokens)")


MODELS = {"vit": vit, "gpt2": gpt2, "encoder": encoder}


def step(model, x, amp: bool) -> None:
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        y = model(x)
        y = y if isinstance(y, torch.Tensor) else y[0]
        loss = y.float().square().mean()
    model.zero_grad(set_to_none=True)
    loss.backward()


# what runs each model's attention on the CPU, with the prior and in its floor (M frozen)
SDPA_MASK = ("the model's SDPA call with the bias as attn_mask: the prior's, which needs a gradient, takes SDPA's "
             "math path, the floor's, a constant, its fused kernel")
KERNELS = {"vit": "timm's SDPA call with the bias as a 3-D attn_mask: SDPA's math path, prior and floor alike",
           "gpt2": "mp.prior_attention: torch's fused kernel with the bias and is_causal, then our own backward "
                   "(maskprior_fast._backward), which the floor runs too, without M's gradient",
           "gpt2 full": SDPA_MASK, "encoder": SDPA_MASK}
LEGEND = """\
bench_retrofit: ms/step: the median over the rounds. ratio: the median over the rounds of the row's time over the
  plain model's in the same round (the rounds are interleaved, so a round's machine load cancels); min-max: the
  lowest and highest of those per-round ratios: two ratios whose ranges overlap differ by noise.
  Rows: the plain model; floor (M constant): its twin with the prior and every M frozen, a constant bias through
  the model's own attention call (what a fixed bias costs; which kernel that takes is said above); + prior: the
  twin with M learnt. What M costs is the prior's ratio over the floor's (said above, model by model)."""


def say(*line):
    """Progress and notes, on stderr: stdout holds the table alone (two header lines, then three rows a model,
    each row's ratio last), for the scripts that read it."""
    print("bench_retrofit:", *line, file=sys.stderr, flush=True)


def twins(key: str, args, device):
    """(label, {row name: step}) of a model: the plain one, its floor (the prior attached, M frozen) and its twin
    with the prior, the same weights, after 2 warm-up steps each; None if its library is missing."""
    try:
        made = [MODELS[key](args) for _ in range(3)]
    except ImportError as e:
        print(f"{key:<44}{'not run':>9}  ({e.name} is not installed)", flush=True)
        return None
    (plain, x, _, label), (with_prior, _, attach, _), (floor, _, _, _) = made
    for model in (with_prior, floor):
        model.load_state_dict(plain.state_dict())
        attach(model)
    for prior in mp.mask_priors(floor):
        prior.bias.requires_grad_(False)
    x, steps = x.to(device), {}
    for name, model in ((label, plain), ("  floor (M constant)", floor), ("  + prior", with_prior)):
        model.to(device).train()
        steps[name] = functools.partial(step, model, x, args.amp)
        for _ in range(2):
            steps[name]()
    return label, steps


def explain(key: str, times: dict, args) -> None:
    """What M costs here (prior / floor per round), what runs the attention, and why, if the floor beat the prior."""
    label, floor, prior = list(times)
    shown, (r, lo, hi) = round_ratios(times, label), round_ratios(times, floor)[prior]
    say(f"{label}: prior / floor {r:.3f}, per round {lo:.3f}-{hi:.3f}: what M costs")
    if args.device == "cpu":
        say(f"{label}: on the CPU, {KERNELS[key + (' full' if key == 'gpt2' and args.full else '')]}")
    if shown[floor][0] > shown[prior][0]:
        why = (f"so noise: in some round the prior is at or above it (prior / floor up to {hi:.3f})" if hi >= 1
               else "yet below it in every round: rerun with more --rounds")
        say(f"{label}: floor above the prior ({shown[floor][0]:.3f} against {shown[prior][0]:.3f}): the floor does "
            f"less work (the same call, or a faster kernel), {why}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="vit,gpt2,encoder", help="comma list of: " + ", ".join(MODELS))
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", action="store_true", help="bf16 autocast")
    p.add_argument("--img-size", type=int, default=224, help="ViT-Tiny input size")
    p.add_argument("--tokens", type=int, default=256, help="GPT-2 sequence length")
    p.add_argument("--full", action="store_true", help="GPT-2's prior as a full N x N M (the default: by distance)")
    p.add_argument("--grid", action="store_true", help="the ViT's prior as a 2-D relative M, one logit per head and "
                   "patch displacement (default: a full N x N M)")
    p.add_argument("--flex", action="store_true", help="GPT-2's prior inside torch's flex_attention (CUDA)")
    p.add_argument("--batch-size", type=int, help="default: 32 (ViT, encoder), 4 (GPT-2)")
    p.add_argument("--tiny", action="store_true", help="two-layer toy models (a smoke run)")
    p.add_argument("--steps", type=int, default=3, help="steps per round")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    device, keys = torch.device(args.device), args.models.split(",")
    for flag, model in (("grid", "vit"), ("full", "gpt2"), ("flex", "gpt2")):
        if getattr(args, flag) and model not in keys:
            p.error(f"--{flag} applies to the {model} model alone; add it to --models ({args.models} has none)")
    say(f"{', '.join(keys)}: each model, its floor and its prior, 2 warm-up steps and {args.rounds} rounds x "
        f"{args.steps} timed steps each: {3 * (2 + args.rounds * args.steps)} forward + backward steps a model")
    print(f"device {device} | amp {args.amp} | torch {torch.__version__} | {args.rounds} rounds x "
          f"{args.steps} steps, median | forward + backward")
    print(f"{'model':<44}{'ms/step':>9}{'min-max':>13}{'ratio':>8}", flush=True)
    for key in keys:
        t0 = time.perf_counter()
        say(f"{key}: building the plain model, its floor and its prior")
        if (made := twins(key, args, device)) is None:
            continue
        label, steps = made
        say(f"{label}: timing 3 x {args.rounds * args.steps} steps")
        times = timed_rounds(steps, device, args.rounds, args.steps)
        for name, (r, lo, hi) in round_ratios(times, label).items():
            span = "" if name == label else f"{lo:.3f}-{hi:.3f}"
            print(f"{name:<44}{1000 * statistics.median(times[name]):>9.2f}{span:>13}{r:>8.3f}", flush=True)
        explain(key, times, args)
        say(f"{label}: done in {time.perf_counter() - t0:.0f} s")
    print(LEGEND, file=sys.stderr)


if __name__ == "__main__":
    main()
