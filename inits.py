"""The initialisations a run starts from, one record each (`Init`). Every list of inits elsewhere is derived from INITS:
train.py's flags and checks, a task's offer (`offered`), the run files' schema (runfiles.INITS) and the report's tables.
A new init is one record here and one test (test_every_task_trains_with_every_init covers each init a task offers).

    python train.py --task parity2 --init NAME        # NAME: a key of INITS"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch

import maskprior as mp

# the task families (a task's KIND)
FAMILIES = ("boolean", "arithmetic", "vision", "lm")


@dataclass(frozen=True)
class Init:
    """One init. `apply(model, prior, config, generator) -> dict` writes it into a freshly built model (prior: the
    run's runfiles.Prior, its pattern and M's logits; config: the run's runconfig.Config) and returns its report.
    `families`: the task kinds that offer it. `reads_prior`: it writes the task's prior (a pattern or M) into the
    model; `owns_m`: the model owns an M (a learnable log sigmoid(M) per layer); `closed_form`: it solves Wq Wk in
    closed form (init_qk_svd_'s flags apply); `fixed_layout`: it is fitted on the token positions, so a task whose
    layout moves from example to example (`Task.FIXED_LAYOUT = False`) cannot offer it."""
    name: str
    apply: Callable
    families: tuple = FAMILIES
    reads_prior: bool = False
    owns_m: bool = False
    closed_form: bool = False
    fixed_layout: bool = False


def _log(text: str) -> None:
    """A line of progress from one process (under torchrun, rank 0's)."""
    if os.environ.get("RANK", "0") == "0":
        print(text, flush=True)


def init_default(model, prior, config, g) -> dict:
    return {}


def init_mask(model, prior, config, g) -> dict:
    """M from the prior's logits: +m_on on the pattern, -m_off elsewhere, the task's own graded M, or soft."""
    return mp.init_mask_(model, logits=prior.logits)


def init_qk_svd(model, prior, config, g) -> dict:
    return mp.init_qk_svd_(model, prior.pattern, config.qk_svd_scale, config.qk_svd_noise,
                           config.qk_svd_norm, config.qk_svd_pos_scale, generator=g)


def init_qk_opt(model, prior, config, g) -> dict:
    return mp.init_qk_opt_(model, prior.pattern, config.qk_opt_steps, config.qk_opt_lr, tol=config.qk_opt_tol,
                           pos_scale=config.qk_opt_pos_scale, generator=g, log=_log)


def init_mimetic(model, prior, config, g) -> dict:
    return mp.init_mimetic_(model, generator=g)


def init_impulse(model, prior, config, g) -> dict:
    """The 2025 structured init: positions x18, QK in closed form for the impulse, V-proj mimetic (0.4 Z - 0.4 I)."""
    report = mp.init_qk_svd_(model, prior.pattern, config.qk_svd_scale, config.qk_svd_noise,
                             config.qk_svd_norm, config.qk_svd_pos_scale or 18.0, generator=g)
    report.update(mp.init_mimetic_(model, qk=None, vo=(0.4, 0.4), generator=g))
    return report


def init_mask_impulse(model, prior, config, g) -> dict:
    """`impulse` with its pattern in M instead of Wq Wk^T: the positions x18 and the mimetic V-proj as `init_impulse`
    gives them, M as `init_mask` gives it (`--pattern`: the hard impulse or the soft bump); Wq, Wk as drawn."""
    scale = config.qk_svd_pos_scale or 18.0         # impulse's scale, applied as init_qk_svd_ applies it
    with torch.no_grad():
        model.pos_emb.mul_(scale)
    report = mp.init_mask_(model, logits=prior.logits)
    report.update(mp.init_mimetic_(model, qk=None, vo=(0.4, 0.4), generator=g))
    report["pos_scale"] = scale
    return report


VISION = ("vision",)
INITS = {i.name: i for i in (
    Init("default", init_default),
    Init("mask", init_mask, reads_prior=True, owns_m=True),
    Init("qk-svd", init_qk_svd, reads_prior=True, closed_form=True, fixed_layout=True),
    Init("qk-opt", init_qk_opt, reads_prior=True, fixed_layout=True),
    Init("mimetic", init_mimetic, VISION),
    Init("impulse", init_impulse, VISION, reads_prior=True, closed_form=True, fixed_layout=True),
    Init("mask-impulse", init_mask_impulse, VISION, reads_prior=True, owns_m=True),
)}


def named(**flags) -> tuple:
    """The names of the inits whose record has every flag given, in INITS' order: named(owns_m=True)."""
    return tuple(n for n, i in INITS.items() if all(getattr(i, k) == v for k, v in flags.items()))


def offered(kind: str, fixed_layout: bool = True) -> tuple:
    """The inits a task of family `kind` offers (a task whose layout moves offers none fitted on positions)."""
    return tuple(n for n, i in INITS.items() if kind in i.families and (fixed_layout or not i.fixed_layout))


# the inits every family offers (the report's ablation), and of them those that write the prior into M or into
# Wq Wk (its persistence figure: where the prior lives)
EVERYWHERE = tuple(n for n, i in INITS.items() if i.families == FAMILIES)
WHERE_THE_PRIOR_LIVES = tuple(n for n in EVERYWHERE if INITS[n].reads_prior)
