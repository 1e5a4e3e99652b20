"""my_task.py: a new task in one class. Run: python examples/my_task.py --task xor-neighbours --init mask"""
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout's experiments
import maskprior as mp  # noqa: E402
import tasks  # noqa: E402
import train  # noqa: E402


@tasks.register("xor-neighbours")
class XorNeighbours(tasks.Task):
    """n random bits; at every position, predict the XOR of its two (cyclic) neighbours."""
    KIND = "boolean"                                  # which results table it joins
    PATTERNS = ("neighbours",)
    DEFAULT_PATTERN = "neighbours"
    HEADLINE = ("acc",)
    PRESETS = {p: {"model": dict(layers=2, heads=2, dim=32, mlp_dim=64),
                   "recipe": dict(lr=1e-3, batch_size=64, schedule="cosine", steps=600, log_every=50)}
               for p in ("small", "paper")}

    # its options: train.py's flags of these names
    def __init__(self, n_bits: int = 16, seed: int = 0):
        self.n, self.seed = n_bits, seed

    def arch(self):
        return {"vocab_size": 2, "seq_len": self.n, "n_outputs": 2, "readout": "tokens"}

    # each bit may look at itself and its two neighbours
    def build_pattern(self, variant):
        return mp.banded_pattern(self.n, 1, circulant=True)

    def setup(self, device="cpu"):
        self.device = torch.device(device)
        self.x_test = self.draw(2048, torch.Generator().manual_seed(10_000 + self.seed))
        return self

    def draw(self, size, g):
        return torch.randint(0, 2, (size, self.n), generator=g).to(self.device)

    def target(self, x):
        return x.roll(1, dims=1) ^ x.roll(-1, dims=1)

    # fresh bits every step, fixed by (seed, step)
    def train_batch(self, step, batch_size):
        return self.draw(batch_size, torch.Generator().manual_seed(self.seed * 1_000_003 + step))

    def loss(self, model, x):
        return F.cross_entropy(model(x).flatten(0, 1).float(), self.target(x).flatten())

    def probe_inputs(self, n=512):
        return self.x_test[:n]

    @torch.no_grad()
    def evaluate(self, model, points=None):
        return {"acc": float((model(self.x_test).argmax(-1) == self.target(self.x_test)).float().mean())}


if __name__ == "__main__":
    raise SystemExit(train.main())
