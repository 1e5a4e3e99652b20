"""Image augmentation batched on the device, as the vision tasks train (tasks.ImageTask):
random crop and flip, RandAugment, random resized crop, resize and centre crop, random erasing,
mixup and cutmix. Images are (B, 3, H, W) tensors; the ops take a torch.Generator and draw
per image, so a batch is one call and a run's augmentation is deterministic in its seed."""
import math

import numpy as np
import torch
import torch.nn.functional as F


def random_crop_flip(x: torch.Tensor, pad: int, generator: torch.Generator, flip: bool = True) -> torch.Tensor:
    """Zero-pad by `pad`, crop back at a random offset per image, flip half left-right; (B, C, H, W) -> the same."""
    b, c, h, w = x.shape
    if pad:
        xp = F.pad(x, (pad, pad, pad, pad))
        oy = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
        ox = torch.randint(0, 2 * pad + 1, (b,), generator=generator, device=x.device)
        rows = (oy[:, None] + torch.arange(h, device=x.device))[:, None, :, None].expand(b, c, h, w + 2 * pad)
        x = xp.gather(2, rows)
        cols = (ox[:, None] + torch.arange(w, device=x.device))[:, None, None, :].expand(b, c, h, w)
        x = x.gather(3, cols)
    if flip:
        f = torch.rand(b, generator=generator, device=x.device) < 0.5
        x = torch.where(f[:, None, None, None], x.flip(-1), x)
    return x


# ---- RandAugment, random resized crop and random erasing. Images stay uint8 (B, 3, H, W) through the photometric and
# geometric ops (computed in float, truncated to 0..255 as Pillow does); per-image arguments: one call serves a batch.

AUG_FILL = (124, 116, 104)          # fill of the geometric ops: the ImageNet mean in 0..255, as timm uses


def _per_image(v, x: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(v, dtype=torch.float32, device=x.device).expand(x.shape[0]).view(-1, 1, 1, 1)


def _gray(x: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> (B, 1, H, W) float, Pillow's "L": (19595 R + 38470 G + 7471 B + 2^15) >> 16."""
    r, g, b = x.long().unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).unsqueeze(1).float()


def _blend(x: torch.Tensor, degenerate: torch.Tensor, factor) -> torch.Tensor:
    """Pillow's ImageEnhance: degenerate + factor * (x - degenerate) per image, truncated toward zero to uint8."""
    return (degenerate + _per_image(factor, x) * (x.float() - degenerate)).clamp(0, 255).to(torch.uint8)


def aug_brightness(x, factor):
    return _blend(x, torch.zeros_like(x, dtype=torch.float32), factor)


def aug_color(x, factor):
    return _blend(x, _gray(x).expand_as(x), factor)


def aug_contrast(x, factor):
    mean = (_gray(x).mean(dim=(1, 2, 3), keepdim=True) + 0.5).floor()      # Pillow: int(mean + 0.5)
    return _blend(x, mean.expand_as(x), factor)


def aug_sharpness(x, factor):
    """Blend with Pillow's SMOOTH filter ([[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13, rounded; border pixels kept)."""
    k = torch.tensor([[1.0, 1, 1], [1, 5, 1], [1, 1, 1]], device=x.device) / 13
    xf = x.float()
    smooth = F.conv2d(xf.flatten(0, 1).unsqueeze(1), k.view(1, 1, 3, 3))
    smooth = smooth.view(*x.shape[:2], x.shape[2] - 2, x.shape[3] - 2)
    degenerate = xf.clone()
    degenerate[..., 1:-1, 1:-1] = (smooth + 0.5).floor()
    return _blend(x, degenerate, factor)


def aug_posterize(x, bits):
    """Keep the top `bits` bits of every value (bits per image, 1..8)."""
    keep = torch.as_tensor(bits, device=x.device).long().expand(x.shape[0]).view(-1, 1, 1, 1)
    return x & (255 - ((1 << (8 - keep)) - 1)).to(torch.uint8)


def aug_solarize(x, threshold):
    """Invert every value >= threshold (per image; 256 leaves the image as it is)."""
    return torch.where(x.float() >= _per_image(threshold, x), 255 - x, x)


def aug_autocontrast(x, *_):
    """Stretch each channel of each image to 0..255 (Pillow's autocontrast, no cutoff)."""
    xf = x.double()
    lo, hi = xf.amin(dim=(2, 3), keepdim=True), xf.amax(dim=(2, 3), keepdim=True)
    scale = torch.full_like(hi, 255.0) / (hi - lo).clamp_min(1)             # a true division, as Pillow's
    return torch.where(hi > lo, (xf * scale - lo * scale).clamp(0, 255).floor(), xf).to(torch.uint8)


def aug_equalize(x, *_):
    """Pillow's equalize per image and channel: lut[i] = (step // 2 + #values below i) // step with
    step = (#values - #values of the last used level) // 255; where step is 0 (e.g. one level) it is kept."""
    b, c = x.shape[:2]
    flat = x.flatten(2).long()                                              # (B, C, HW)
    hist = torch.zeros(b, c, 256, dtype=torch.long, device=x.device).scatter_add_(2, flat, torch.ones_like(flat))
    last = 255 - (hist.flip(-1) > 0).long().argmax(-1)                     # highest level present
    step = (flat.shape[-1] - hist.gather(2, last.unsqueeze(-1)).squeeze(-1)) // 255
    below = hist.cumsum(-1) - hist
    lut = ((step.unsqueeze(-1) // 2 + below) // step.clamp_min(1).unsqueeze(-1)).clamp(max=255)
    lut = torch.where((step > 0).unsqueeze(-1), lut, torch.arange(256, device=x.device))
    return lut.gather(2, flat).view_as(x).to(torch.uint8)


def _affine(x: torch.Tensor, m: torch.Tensor, fill=AUG_FILL) -> torch.Tensor:
    """Sample every output pixel (i, j) at the input point (x, y) = m @ (j, i, 1), pixel units, per
    image m (B, 2, 3); bilinear, points outside the image take `fill`."""
    b, c, h, w = x.shape
    ii, jj = torch.meshgrid(torch.arange(h, device=x.device, dtype=torch.float32),
                            torch.arange(w, device=x.device, dtype=torch.float32), indexing="ij")
    pts = torch.stack([jj, ii, torch.ones_like(ii)], -1).view(1, h * w, 3)
    src = pts @ m.float().transpose(1, 2)                                   # (B, HW, 2): input x, y
    grid = torch.stack([(src[..., 0] + 0.5) / w * 2 - 1, (src[..., 1] + 0.5) / h * 2 - 1], -1).view(b, h, w, 2)
    f = torch.tensor(fill, dtype=torch.float32, device=x.device).view(1, c, 1, 1)
    out = F.grid_sample(x.float() - f, grid, mode="bilinear", padding_mode="zeros", align_corners=False) + f
    return (out + 0.5).clamp(0, 255).to(torch.uint8)


def _matrices(x, a, b, e, d, f_, g):
    n = x.shape[0]
    rows = [torch.as_tensor(v, dtype=torch.float32, device=x.device).expand(n) for v in (a, b, e, d, f_, g)]
    return torch.stack(rows, -1).view(n, 2, 3)


def aug_shear_x(x, s):
    """Input x = j + s * i (Pillow's AFFINE (1, s, 0, 0, 1, 0), origin top left)."""
    return _affine(x, _matrices(x, 1, s, 0, 0, 1, 0))


def aug_shear_y(x, s):
    return _affine(x, _matrices(x, 1, 0, 0, s, 1, 0))


def aug_translate_x(x, fraction):
    """Shift left by fraction * width (negative: right)."""
    return _affine(x, _matrices(x, 1, 0, torch.as_tensor(fraction, device=x.device) * x.shape[3], 0, 1, 0))


def aug_translate_y(x, fraction):
    return _affine(x, _matrices(x, 1, 0, 0, 0, 1, torch.as_tensor(fraction, device=x.device) * x.shape[2]))


def aug_rotate(x, degrees):
    """Rotate counter-clockwise by `degrees` about the image centre."""
    t = torch.deg2rad(torch.as_tensor(degrees, dtype=torch.float32, device=x.device)).expand(x.shape[0])
    cx, cy = (x.shape[3] - 1) / 2, (x.shape[2] - 1) / 2
    cos, sin = t.cos(), t.sin()
    return _affine(x, _matrices(x, cos, -sin, cx - cos * cx + sin * cy, sin, cos, cy - sin * cx - cos * cy))


def aug_identity(x, *_):
    return x


# RandAugment's ops and how a magnitude m in [0, 10] maps to each op's argument (a random sign
# where the op has a direction); every op with an argument is the identity at m = 0.
RANDAUG_OPS = {
    "identity": (aug_identity, None),
    "autocontrast": (aug_autocontrast, None),
    "equalize": (aug_equalize, None),
    "rotate": (aug_rotate, lambda m, s: s * 30.0 * m / 10),
    "solarize": (aug_solarize, lambda m, s: 256.0 - 256.0 * m / 10),
    "color": (aug_color, lambda m, s: 1.0 + s * 0.9 * m / 10),
    "posterize": (aug_posterize, lambda m, s: 8 - (4 * m / 10).round()),
    "contrast": (aug_contrast, lambda m, s: 1.0 + s * 0.9 * m / 10),
    "brightness": (aug_brightness, lambda m, s: 1.0 + s * 0.9 * m / 10),
    "sharpness": (aug_sharpness, lambda m, s: 1.0 + s * 0.9 * m / 10),
    "shear_x": (aug_shear_x, lambda m, s: s * 0.3 * m / 10),
    "shear_y": (aug_shear_y, lambda m, s: s * 0.3 * m / 10),
    "translate_x": (aug_translate_x, lambda m, s: s * 0.45 * m / 10),
    "translate_y": (aug_translate_y, lambda m, s: s * 0.45 * m / 10),
}


def rand_augment(x: torch.Tensor, generator: torch.Generator, magnitude: float = 9.0,
                 std: float = 0.5, n_ops: int = 2, prob: float = 0.5) -> torch.Tensor:
    """RandAugment on a uint8 batch (B, 3, H, W): `n_ops` times, each image draws an op of RANDAUG_OPS uniformly and
    applies it with probability `prob`, at magnitude m ~ N(magnitude, std^2) clipped to [0, 10] (per image and op)."""
    b = x.shape[0]
    x = x.clone()
    for _ in range(n_ops):
        op = torch.randint(0, len(RANDAUG_OPS), (b,), generator=generator, device=x.device)
        use = torch.rand(b, generator=generator, device=x.device) < prob
        m = (magnitude + std * torch.randn(b, generator=generator, device=x.device)).clamp(0, 10)
        sign = torch.where(torch.rand(b, generator=generator, device=x.device) < 0.5, -1.0, 1.0)
        for k, (fn, arg) in enumerate(RANDAUG_OPS.values()):
            pick = (op == k) & use
            if not bool(pick.any()):
                continue
            sel = pick.nonzero().squeeze(1)
            x[sel] = fn(x[sel], None if arg is None else arg(m[sel], sign[sel]))
    return x


def _sample(x: torch.Tensor, x0, y0, w, h, out: int, flip=None) -> torch.Tensor:
    """Each image's box (x0, y0, w, h; pixels) resampled bilinearly to out x out, mirrored where `flip`; uint8."""
    b, size = x.shape[0], x.shape[-1]
    t = (torch.arange(out, device=x.device, dtype=torch.float32) + 0.5) / out     # (out,) in (0, 1)
    tx = t[None].expand(b, -1) if flip is None else torch.where(flip[:, None], 1 - t[None], t[None])
    gx = ((x0[:, None] + tx * w[:, None]) / size * 2 - 1)                              # (B, out)
    gy = ((y0[:, None] + t[None] * h[:, None]) / size * 2 - 1)
    grid = torch.stack([gx[:, None, :].expand(b, out, out), gy[:, :, None].expand(b, out, out)], -1)
    y = F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)
    return (y + 0.5).clamp(0, 255).to(torch.uint8)


def _first_box(b: int, pixels: float, fraction, ratio, generator: torch.Generator, device, fits) -> tuple:
    """timm's 10 attempts per image at a box of area pixels * U(fraction) and aspect ratio r
    log-uniform in `ratio`, its sides rounded (sqrt(area * r), sqrt(area / r)), and the first whose
    sides `fits(p, q)` keeps: (whether any does, its two sides), each (b,)."""
    area = pixels * (fraction[0] + (fraction[1] - fraction[0]) * torch.rand(b, 10, generator=generator, device=device))
    r = torch.exp(math.log(ratio[0]) + (math.log(ratio[1]) - math.log(ratio[0]))
                  * torch.rand(b, 10, generator=generator, device=device))
    p, q = (area * r).sqrt().round(), (area / r).sqrt().round()
    ok = fits(p, q)
    first = ok.float().argmax(1, keepdim=True)
    return ok.any(1), p.gather(1, first).squeeze(1), q.gather(1, first).squeeze(1)


def resize(x: torch.Tensor, out: int) -> torch.Tensor:
    """Each whole image resampled bilinearly to out x out; uint8 (B, C, H, H) in and out."""
    corner = torch.zeros(len(x), device=x.device)
    side = torch.full((len(x),), float(x.shape[-1]), device=x.device)
    return _sample(x, corner, corner, side, side, out)


def random_resized_crop(x: torch.Tensor, out: int, generator: torch.Generator, scale=(0.08, 1.0),
                        ratio=(3 / 4, 4 / 3), flip: bool = True) -> torch.Tensor:
    """timm's RandomResizedCrop + horizontal flip on a uint8 batch (B, C, S, S) -> (B, C, out, out): per image a box of
    area fraction U(scale) and log-uniform aspect ratio (first of 10 draws that fits, else the whole image) at a random
    place, resampled bilinearly (32 x 32 CIFAR up to a 224 x 224 input), then mirrored with probability 1/2."""
    b, s = x.shape[0], x.shape[-1]
    kw = dict(generator=generator, device=x.device)
    fits, w, h = _first_box(b, s * s, scale, ratio, generator, x.device,
                            lambda w, h: (w <= s) & (h <= s) & (w > 0) & (h > 0))
    whole = torch.full((b,), float(s), device=x.device)
    w, h = torch.where(fits, w, whole), torch.where(fits, h, whole)
    x0 = (torch.rand(b, **kw) * (s - w + 1)).floor()
    y0 = (torch.rand(b, **kw) * (s - h + 1)).floor()
    return _sample(x, x0, y0, w, h, out, torch.rand(b, **kw) < 0.5 if flip else None)


def resize_center_crop(x: torch.Tensor, out: int, crop_pct: float) -> torch.Tensor:
    """The evaluation view: resize to out / crop_pct (bicubic), keep the centre out x out; uint8."""
    size = int(math.floor(out / crop_pct))
    y = F.interpolate(x.float(), size=(size, size), mode="bicubic", align_corners=False)
    top = (size - out) // 2
    return (y[..., top:top + out, top:top + out] + 0.5).clamp(0, 255).to(torch.uint8)


def mixup(x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor, lam: float):
    """Mixup (Zhang et al. 2018): each image and its target blended with those of the batch permuted
    by `perm`, `lam` of it its own. x (B, C, H, W), y (B, n_classes), perm (B,) -> (x, y) alike."""
    return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


def cutmix(x: torch.Tensor, y: torch.Tensor, perm: torch.Tensor, lam: float, g: torch.Generator):
    """CutMix (Yun et al. 2019): a square of side S sqrt(1 - lam) around a centre drawn from `g`
    (clipped at the border) pasted from the batch permuted by `perm`; the targets mixed by the area
    each image keeps. x (B, C, S, S), y (B, n_classes), perm (B,) -> (x, y) of the same shapes."""
    s = x.shape[-1]
    side = int(s * math.sqrt(1 - lam))
    cy, cx = (int(v) for v in torch.randint(0, s, (2,), generator=g, device=x.device))
    y0, y1, x0, x1 = max(cy - side // 2, 0), min(cy + side // 2, s), max(cx - side // 2, 0), min(cx + side // 2, s)
    x = x.clone()
    x[:, :, y0:y1, x0:x1] = x[perm][:, :, y0:y1, x0:x1]
    kept = 1 - (y1 - y0) * (x1 - x0) / (s * s)
    return x, kept * y + (1 - kept) * y[perm]


def mix_batch(x: torch.Tensor, y: torch.Tensor, mixup_alpha: float, cutmix_alpha: float,
              g: torch.Generator, rng: np.random.Generator):
    """timm's switch: cutmix or mixup (each with probability 1/2 when both are on, drawn from `g`),
    lam ~ Beta(alpha, alpha) from `rng`, the partner images a permutation of the batch drawn from
    `g`; both alphas 0: the batch as it is. x (B, C, S, S), y (B, n_classes) -> (x, y) alike."""
    if mixup_alpha <= 0 and cutmix_alpha <= 0:
        return x, y
    perm = torch.randperm(len(x), generator=g, device=x.device)
    cut = cutmix_alpha > 0 and (mixup_alpha == 0 or torch.rand(1, generator=g, device=x.device) < 0.5)
    alpha = cutmix_alpha if cut else mixup_alpha
    lam = float(rng.beta(alpha, alpha))
    return cutmix(x, y, perm, lam, g) if cut else mixup(x, y, perm, lam)


def random_erasing(x: torch.Tensor, prob: float, generator: torch.Generator, area=(0.02, 1 / 3),
                   ratio=(0.3, 1 / 0.3)) -> torch.Tensor:
    """timm's RandomErasing, mode 'pixel', on a normalised float batch (B, C, H, W): with
    probability `prob` an image gets one box of area fraction U(area) and log-uniform aspect ratio
    (the first of 10 draws that fits) filled with N(0, 1) noise per pixel and channel."""
    b, c, hh, ww = x.shape
    kw = dict(generator=generator, device=x.device)
    use = torch.rand(b, **kw) < prob
    fits, h, w = _first_box(b, hh * ww, area, ratio, generator, x.device, lambda h, w: (h < hh) & (w < ww))
    top = (torch.rand(b, **kw) * (hh - h + 1)).floor()
    left = (torch.rand(b, **kw) * (ww - w + 1)).floor()
    rows = torch.arange(hh, device=x.device)[None, :, None]
    cols = torch.arange(ww, device=x.device)[None, None, :]
    box = ((rows >= top[:, None, None]) & (rows < (top + h)[:, None, None])
           & (cols >= left[:, None, None]) & (cols < (left + w)[:, None, None]) & (use & fits)[:, None, None])
    return torch.where(box[:, None], torch.randn(x.shape, **kw, dtype=x.dtype), x)
