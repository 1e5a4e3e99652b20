"""Every dataset of the paper: data, interaction patterns and metrics.

A task object offers what train.py needs:
    arch()                      -> dict of model fields (vocab, sequence length, outputs, readout)
    pattern(variant)            -> bool (N, N) or (H, N, N) interaction pattern
    setup(seed, device)         -> build or load the data (call once)
    train_batch(step, size)     -> the batch of a step (deterministic in step and seed)
    loss(model, batch)          -> scalar training loss
    evaluate(model)             -> dict of metrics on the test split
    probe_inputs()              -> a fixed real batch for the prior-mass probe
Tasks are built by `make_task(name, **options)`; `TASKS` lists the names.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F

import maskprior as mp


class TaskError(ValueError):
    """Bad task options or data files; train.py prints the message and exits with status 2."""


# ----------------------------------------------------------------------------------------
# Boolean GOTU tasks (Abbe, Bengio, Lotfi, Rizk 2023): inputs in {-1, +1}^n, one token
# per bit after a CLS token (sequence position of bit i is i + 1), MSE regression.


def cube(n: int) -> np.ndarray:
    """(2^n, n) int8 array of every point of {-1, +1}^n; row r has bit i = +1 iff bit i of r is 0."""
    r = np.arange(2 ** n, dtype=np.int64)[:, None]
    bits = (r >> np.arange(n)[None, :]) & 1
    return (1 - 2 * bits).astype(np.int8)


def monomials(n: int, max_degree: int) -> list[tuple[int, ...]]:
    """All subsets of range(n) of size <= max_degree, by degree then lexicographically."""
    return [s for d in range(max_degree + 1) for s in itertools.combinations(range(n), d)]


def chi(x: np.ndarray, subset) -> np.ndarray:
    """The monomial prod_{i in subset} x_i on rows of x (B, n) -> (B,) float64."""
    return np.prod(x[:, list(subset)].astype(np.float64), axis=1) if subset else np.ones(len(x))


def parity_fn(bits):
    return lambda x: chi(x, bits)


def majority_fn(bits):
    return lambda x: np.sign(x[:, list(bits)].astype(np.float64).sum(axis=1))


def cyclic_fn(n: int, k: int = 3):
    return lambda x: sum(chi(x, [(i + j) % n for j in range(k)]) for i in range(n))


def _null_space(a: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """Orthonormal columns spanning {z : a z = 0}, from the eigenvectors of a^T a."""
    w, v = np.linalg.eigh(a.T @ a)
    return v[:, w <= tol * max(float(w.max(initial=0.0)), 1.0)]


def min_degree_interpolator(x_seen: np.ndarray, y_seen: np.ndarray, x_eval: np.ndarray,
                            max_degree: int | None = None):
    """The min-degree interpolator (MDI) of the data (x_seen, y_seen), evaluated on x_eval.

    The interpolator with the smallest degree profile (W_d, W_{d-1}, ..., W_0),
    lexicographically, where W_k is its Fourier weight on degree-k monomials: the smallest
    degree d that fits the data exactly, then least squares on the coefficients degree by
    degree (highest first) over the remaining freedom. x_* are (B, n) arrays in {-1, +1}.
    Returns (predictions on x_eval, degree, {monomial: coefficient}).
    """
    n = x_seen.shape[1]
    max_degree = n if max_degree is None else max_degree
    ys = y_seen.astype(np.float64)
    for d in range(max_degree + 1):
        mons = monomials(n, d)
        phi = np.stack([chi(x_seen, s) for s in mons], axis=1)
        c, *_ = np.linalg.lstsq(phi, ys, rcond=None)
        if np.abs(phi @ c - ys).max() > 1e-6 * max(1.0, np.abs(ys).max()):
            continue
        null = _null_space(phi)                  # coefficient directions the data cannot see
        degrees = np.array([len(m) for m in mons])
        for k in range(d, -1, -1):
            if null.shape[1] == 0:
                break
            idx = degrees == k
            z, *_ = np.linalg.lstsq(null[idx], -c[idx], rcond=None)
            c = c + null @ z
            null = null @ _null_space(null[idx])
        pred = np.stack([chi(x_eval, s) for s in mons], axis=1) @ c
        return pred, d, {m: float(v) for m, v in zip(mons, c) if abs(v) > 1e-9}
    raise ValueError(f"no interpolator of degree <= {max_degree}")


@dataclass
class BooleanTask:
    """A GOTU task: f on {-1,+1}^n, trained on the seen domain, tested on the whole cube.

    `unseen` fixes some bits (bit -> value); the unseen domain U is the subcube where all of
    them hold, the seen domain its complement. `train_size=None` trains on every seen point
    (each once per epoch); an integer draws that many seen points uniformly with replacement.
    `exact=True` marks an integer-valued target: accuracy is the rounded exact match (sign
    accuracy is reported too); otherwise accuracy is sign accuracy.
    """
    name: str
    n_bits: int
    target: Callable[[np.ndarray], np.ndarray]
    unseen: dict
    patterns: dict                      # variant name -> bool (N, N), N = n_bits + 1 (CLS first)
    default_pattern: str
    top_monomial: tuple
    train_size: int | None = None
    exact: bool = False
    description: str = ""
    support: tuple | None = None        # bits the target depends on (None: all); speeds up the MDI
    kind: str = "boolean"
    _cache: dict = field(default_factory=dict, repr=False)

    def arch(self) -> dict:
        return {"vocab_size": 2, "seq_len": self.n_bits, "n_outputs": 1, "readout": "cls"}

    def pattern(self, variant: str | None = None) -> torch.Tensor:
        variant = variant or self.default_pattern
        if variant not in self.patterns:
            raise TaskError(f"task {self.name} has no pattern {variant!r}; choose from {sorted(self.patterns)}")
        return self.patterns[variant]

    def in_unseen(self, x: np.ndarray) -> np.ndarray:
        return np.all([x[:, b] == v for b, v in self.unseen.items()], axis=0)

    def setup(self, seed: int, device="cpu"):
        """Build the train set (seeded) and the whole cube as test set, on `device`."""
        x_all = cube(self.n_bits)
        unseen = self.in_unseen(x_all)
        seen = x_all[~unseen]
        if self.train_size is None:
            x_train = seen
        else:
            rng = np.random.default_rng(seed)
            x_train = seen[rng.integers(0, len(seen), size=self.train_size)]
        self.seed, self.device = seed, torch.device(device)
        self.x_train = torch.as_tensor((x_train > 0).astype(np.int64), device=device)
        self.y_train = torch.as_tensor(self.target(x_train), dtype=torch.float32, device=device)
        self.x_test = torch.as_tensor((x_all > 0).astype(np.int64), device=device)
        self.y_test = torch.as_tensor(self.target(x_all), dtype=torch.float32, device=device)
        self.unseen_mask = torch.as_tensor(unseen, device=device)
        self.chi_top = torch.as_tensor(chi(x_all, self.top_monomial), dtype=torch.float32, device=device)
        return self

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    def steps_per_epoch(self, batch_size: int) -> int:
        return math.ceil(self.n_train / batch_size)

    def train_batch(self, step: int, batch_size: int):
        """Batch `step` of an epoch-wise shuffle; epoch e's order is fixed by (seed, e)."""
        spe = self.steps_per_epoch(batch_size)
        epoch, i = divmod(step, spe)
        if self._cache.get("perm_epoch") != epoch:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self._cache["perm"] = torch.randperm(self.n_train, generator=g).to(self.device)
            self._cache["perm_epoch"] = epoch
        idx = self._cache["perm"][i * batch_size:(i + 1) * batch_size]
        return self.x_train[idx], self.y_train[idx]

    def loss(self, model, batch) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(model(x).squeeze(-1).float(), y)

    def probe_inputs(self, n: int = 512) -> torch.Tensor:
        """A fixed batch of cube points, seen and unseen alike."""
        g = torch.Generator().manual_seed(0)
        return self.x_test[torch.randperm(len(self.x_test), generator=g)[:n].to(self.device)]

    @torch.no_grad()
    def predict(self, model, batch_size: int = 8192) -> torch.Tensor:
        return torch.cat([model(self.x_test[i:i + batch_size]).squeeze(-1).float()
                          for i in range(0, len(self.x_test), batch_size)])

    def metrics(self, pred: torch.Tensor) -> dict:
        """Accuracy and MSE over the cube and on U, the top monomial's Fourier coefficient."""
        y, u = self.y_test, self.unseen_mask
        sign_ok = (torch.sign(pred) == torch.sign(y)).float()
        ok = (torch.round(pred) == y).float() if self.exact else sign_ok
        err = (pred - y) ** 2
        out = {"acc": ok.mean(), "acc_unseen": ok[u].mean(), "acc_seen": ok[~u].mean(),
               "mse": err.mean(), "mse_unseen": err[u].mean(), "mse_seen": err[~u].mean(),
               "coef_top": (pred * self.chi_top).mean()}
        if self.exact:
            out["sign_acc"], out["sign_acc_unseen"] = sign_ok.mean(), sign_ok[u].mean()
        return {k: float(v) for k, v in out.items()}

    def evaluate(self, model) -> dict:
        metrics = self.metrics(self.predict(model))
        mdi = self.mdi()
        metrics["mdi_acc"] = mdi["acc"]
        metrics["mdi_acc_unseen"] = mdi["acc_unseen"]
        if self.exact:
            metrics["mdi_sign_acc"] = mdi["sign_acc"]
        return metrics

    def mdi(self) -> dict:
        """The MDI's metrics on this task (cached): what a min-degree learner would predict."""
        if "mdi" not in self._cache:
            x_all = cube(self.n_bits)
            seen = ~self.in_unseen(x_all)
            # The MDI only involves the bits the target and the unseen domain depend on
            # (it is unique, and flipping any other bit maps the problem to itself), so it
            # is solved on that sub-cube and read back on the whole cube.
            rel = sorted(set(range(self.n_bits) if self.support is None else self.support) | set(self.unseen))
            x_sub = np.unique(x_all[seen][:, rel], axis=0)
            full = np.zeros((len(x_sub), self.n_bits), dtype=np.int8)
            full[:, rel] = x_sub
            _, degree, coefs = min_degree_interpolator(x_sub, self.target(full), x_sub)
            pred = sum(v * chi(x_all, [rel[i] for i in m]) for m, v in coefs.items())
            coefs = {tuple(rel[i] for i in m): v for m, v in coefs.items()}
            if not hasattr(self, "y_test"):
                self.setup(0)
            m = self.metrics(torch.as_tensor(pred, dtype=torch.float32, device=self.device))
            m["degree"] = degree
            m["coefficients"] = {"x" + "x".join(map(str, k)) if k else "1": v for k, v in coefs.items()}
            self._cache["mdi"] = m
        return self._cache["mdi"]


def _pos(bits):
    """Sequence positions of bits (CLS is position 0)."""
    return [b + 1 for b in bits]


def gotu_patterns(n_bits: int, bits) -> dict:
    """Pattern variants for a task whose target lives on `bits`.

    clique: CLS -> bits, every pair of bits both ways, self-loops (the default);
    cls:    CLS -> bits and self-loops only (no pairwise edge);
    Both keep every position's self-loop so no row is empty.
    """
    n = n_bits + 1
    pos = _pos(bits)
    cls_edges = [(0, p) for p in pos]
    pair_edges = [(a, b) for a in pos for b in pos if a != b]
    return {"clique": mp.pattern_from_pairs(n, cls_edges + pair_edges),
            "cls": mp.pattern_from_pairs(n, cls_edges)}


def cyclic_patterns(n_bits: int, width: int = 2) -> dict:
    """band: bits attend within |i - j| <= width (mod n), CLS -> every bit (the default);
    band-only: the band without the CLS row (CLS attends to itself)."""
    n = n_bits + 1
    band = mp.embed_pattern(mp.banded_pattern(n_bits, width, circulant=True), 1, n)
    band_only = band.clone()
    band_only[0, 0] = True
    with_cls = band.clone()
    with_cls[0, :] = True
    return {"band": with_cls, "band-only": band_only}


def parity2(**_) -> BooleanTask:
    bits = (0, 1)
    return BooleanTask("parity2", 15, parity_fn(bits), {0: -1, 1: -1}, gotu_patterns(15, bits), "clique",
                       bits, None, False, "x0*x1; unseen x0=x1=-1; all 24,576 seen points", bits)


def majority3(**_) -> BooleanTask:
    bits = (0, 1, 2)
    return BooleanTask("majority3", 15, majority_fn(bits), {0: -1, 1: -1}, gotu_patterns(15, bits), "clique",
                       bits, 32768, False, "sign(x0+x1+x2); unseen x0=x1=-1; 32,768 uniform seen draws", bits)


def cyclic3(**_) -> BooleanTask:
    return BooleanTask("cyclic3", 15, cyclic_fn(15), {0: -1, 1: -1, 2: -1}, cyclic_patterns(15), "band",
                       (0, 1, 2), None, True, "sum_i x_i x_{i+1} x_{i+2} (mod 15); unseen x0=x1=x2=-1")


def _parse_bits(text, what: str, n_bits: int) -> tuple:
    try:
        bits = tuple(int(b) for b in str(text).split(",") if b.strip() != "")
    except ValueError:
        raise TaskError(f"--{what} must be comma-separated bit indices like 0,1,2, got {text!r}") from None
    if not bits or any(not 0 <= b < n_bits for b in bits) or len(set(bits)) != len(bits):
        raise TaskError(f"--{what} must list distinct bits in 0..{n_bits - 1}, got {text!r}")
    return bits


def custom_boolean(kind: str, n_bits: int = 15, bits="0,1,2", unseen="0,1", train_size=None, **_) -> BooleanTask:
    """k-parity or k-majority on chosen `bits`; the unseen domain sets the `unseen` bits to -1."""
    if not 2 <= n_bits <= 20:
        raise TaskError(f"--n-bits must be in 2..20 (the whole cube is enumerated), got {n_bits}")
    b = _parse_bits(bits, "bits", n_bits)
    u = _parse_bits(unseen, "unseen", n_bits)
    if kind == "kmajority" and len(b) % 2 == 0:
        raise TaskError(f"--bits for kmajority needs an odd number of bits (ties have no sign), got {len(b)}")
    fn = parity_fn(b) if kind == "kparity" else majority_fn(b)
    name = f"{kind}[{','.join(map(str, b))}|U:{','.join(map(str, u))}]"
    desc = f"{kind} on bits {b}; unseen {' and '.join(f'x{i}=-1' for i in u)}"
    return BooleanTask(name, n_bits, fn, {i: -1 for i in u}, gotu_patterns(n_bits, b), "clique", b,
                       train_size, False, desc, b)


TASKS = {
    "parity2": parity2,
    "majority3": majority3,
    "cyclic3": cyclic3,
    "kparity": lambda **o: custom_boolean("kparity", **o),
    "kmajority": lambda **o: custom_boolean("kmajority", **o),
}


def make_task(name: str, **options):
    """Build a task by name; `options` are the task flags of train.py (unused ones ignored)."""
    if name not in TASKS:
        raise TaskError(f"unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name](**options)
