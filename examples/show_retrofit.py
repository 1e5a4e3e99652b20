"""M of a retrofitted Hugging Face model, before and after training: a GPT-2 (2 layers x 4 heads,
random weights: nothing is downloaded) with a relative prior learns a copy task (each token repeats
the one 3 back), then reporting.show.draw_model draws M's start, its end and end - start.

    python examples/show_retrofit.py results/show/gpt2-retrofit/m.png      # about 20 s on a 2-core CPU"""
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout's reporting/
import maskprior as mp  # noqa: E402
import maskprior_retrofit as retrofit  # noqa: E402
from reporting.show import draw_model  # noqa: E402

torch.manual_seed(0)
gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=32,
                                  bos_token_id=0, eos_token_id=0))
retrofit.add_mask_prior(gpt2, logits=mp.causal_distance_logits(32, 4))
start = mp.prior_snapshot(gpt2)                          # after add_mask_prior, before training
opt = torch.optim.AdamW(mp.param_groups(gpt2, 0.01), lr=3e-3)
for step in range(300):
    x = torch.randint(0, 32, (32, 3)).repeat(1, 11)[:, :32]
    loss = gpt2(input_ids=x, labels=x).loss
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"loss {loss.item():.3f}")
out = sys.argv[1] if len(sys.argv) > 1 else "m.png"
os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
print(draw_model(gpt2, out,
                 "GPT-2 (2 x 4 heads, random init) + relative prior, 300 steps of a period-3 copy task", start))
