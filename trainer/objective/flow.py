"""Flow-matching objective: sigma sampling, noise, loss weights, x_t and the velocity target.

Convention (ComfyUI's flow models, Flux2 and Z-Image): x_t = (1-σ)·x0 + σ·ε and the
model predicts v = ε - x0, so denoised = x_t - σ·v. All randomness is drawn here, in
numpy, from one seeded np.random.Generator, so the torch and MLX backends see
identical noise, sigmas and caption-dropout decisions. No torch or mlx import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

# Keeps σ off 0 and 1 whatever the sampler and shift do: Φ⁻¹ and the logit are infinite
# there, the bell weight is exactly 0 there (a wasted sample), and σ = 0 means x_t = x0,
# nothing to denoise. 1e-5 is far below any σ a sampler visits (ComfyUI's smallest is
# ~1e-3), so clamping changes no realistic draw.
SIGMA_MIN = 1e-5
SIGMA_MAX = 1.0 - 1e-5
_U_EPS = 1e-12  # the uniform fed to Φ⁻¹ is kept inside (0,1) before the final clamp

_STANDARD_NORMAL = NormalDist()


# --- content_or_style: bias the uniform u before the inverse CDF -------------------------
# ai-toolkit (ostris/ai-toolkit, jobs/process/BaseSDTrainProcess.py) draws a timestep
# index u³·N for 'content' and (1-u³)·N for 'style', where index 0 is t = 1000 (σ = 1).
# In σ-space that is σ = 1 - u³ (high noise) and σ = u³ (low noise).
_BIASES = {
    "balanced": lambda u: u,
    "content": lambda u: 1.0 - u**3,
    "style": lambda u: u**3,
}


def _uniform(u: np.ndarray, settings: ObjectiveSettings) -> np.ndarray:
    """σ = u'."""
    return u


def _logit_normal(u: np.ndarray, settings: ObjectiveSettings) -> np.ndarray:
    """σ = sigmoid(mean + std·Φ⁻¹(u')), the inverse CDF of the logit-normal (SD3)."""
    u = np.clip(u, _U_EPS, 1.0 - _U_EPS)
    z = np.fromiter((_STANDARD_NORMAL.inv_cdf(p) for p in u.tolist()), dtype=np.float64, count=u.size)
    logits = settings.logit_mean + settings.logit_std * z
    return 0.5 * (1.0 + np.tanh(0.5 * logits))  # sigmoid without exp overflow


_SAMPLERS = {"uniform": _uniform, "logit_normal": _logit_normal}


def resolution_shift(image_tokens: int) -> float:
    """Flux2 training shift exp(μ), μ linear in image tokens: 0.5 at 256, 1.15 at 4096."""
    # kohya-ss/musubi-tuner src/musubi_tuner/training/trainer_base.py, timestep_sampling
    # "flux2_shift": mu = get_lin_function(y1=0.5, y2=1.15)(h * w) on the packed Flux2
    # latent (one token per cell), shift = exp(mu), then t·s/(1+(s-1)·t); get_lin_function
    # (utils/train_utils.py) has x1=256, x2=4096. This line is also the num_steps ≥ 200
    # limit of Flux2's inference compute_empirical_mu (a2 = 0.00016927, b2 = 0.45666666)
    # in diffusers' pipeline_flux2.py and ComfyUI's comfy_extras/nodes_flux.py.
    if image_tokens < 1:
        raise ValueError(f"image_tokens must be >= 1, got {image_tokens}")
    slope = (1.15 - 0.5) / (4096 - 256)
    mu = 0.5 + slope * (image_tokens - 256)
    return math.exp(mu)


_SHIFTS = {
    "none": lambda settings, tokens: 1.0,
    "static": lambda settings, tokens: settings.shift,
    "resolution": lambda settings, tokens: resolution_shift(tokens),
}


# --- bell loss weighting ------------------------------------------------------------------
# ai-toolkit's `linear_timesteps` weights (ostris/ai-toolkit,
# toolkit/samplers/custom_flowmatch_sampler.py, "Bell-Shaped Mean-Normalized Timestep
# Weighting"): y = exp(-2((i - N/2)/N)²) over i in 0..N-1 (N = 1000, σ = 1 - i/N), minus its
# minimum, scaled to mean 1. As a continuous function of σ that is
#   w(σ) = (exp(-2(σ-½)²) - e^{-½}) / C,   C = ∫₀¹ exp(-2(σ-½)²) dσ - e^{-½}
#        = √(π/2)·erf(1/√2) - e^{-½} ≈ 0.249094,
# so its mean over σ ~ U(0,1) is exactly 1, its peak w(½) ≈ 1.5796, and w(0) = w(1) = 0.
_BELL_FLOOR = math.exp(-0.5)
_BELL_NORM = math.sqrt(math.pi / 2.0) * math.erf(1.0 / math.sqrt(2.0)) - _BELL_FLOOR


def _bell(sigmas: np.ndarray) -> np.ndarray:
    """Mean-1 bell over σ ∈ [0,1], peak at σ = ½."""
    return (np.exp(-2.0 * (sigmas - 0.5) ** 2) - _BELL_FLOOR) / _BELL_NORM


_WEIGHTINGS = {"none": np.ones_like, "bell": _bell}

SAMPLINGS = tuple(_SAMPLERS)
SHIFT_MODES = tuple(_SHIFTS)
CONTENT_OR_STYLE = tuple(_BIASES)
LOSS_WEIGHTINGS = tuple(_WEIGHTINGS)


def _check_choice(field: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raise a ValueError naming the field, the bad value and the allowed values."""
    if value not in allowed:
        raise ValueError(f"{field} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class ObjectiveSettings:
    """How sigmas are drawn and losses weighted; validated on construction."""

    sampling: str = "uniform"  # uniform or logit_normal (SD3's sigmoid of a normal)
    logit_mean: float = 0.0  # logit_normal: centre of the logit; > 0 favours high noise
    logit_std: float = 1.0  # logit_normal: spread of the logit; larger is flatter
    content_or_style: str = "balanced"  # content biases to high noise, style to low
    shift_mode: str = "none"  # none, static (uses `shift`) or resolution (Flux2, from tokens)
    shift: float = 1.0  # static shift s: σ → s·σ/(1+(s-1)·σ); s > 1 favours high noise
    loss_weighting: str = "none"  # none or bell (ai-toolkit linear_timesteps)
    unmasked_weight: float = 1.0  # masked training: the loss weight of a mask's black cells (companion_batch.py)
    sigma_range: tuple[float, float] = (0.0, 1.0)  # σ drawn inside [low, high] (a Wan 2.2 expert's side)

    def __post_init__(self) -> None:
        _check_choice("sampling", self.sampling, SAMPLINGS)
        _check_choice("content_or_style", self.content_or_style, CONTENT_OR_STYLE)
        _check_choice("shift_mode", self.shift_mode, SHIFT_MODES)
        _check_choice("loss_weighting", self.loss_weighting, LOSS_WEIGHTINGS)
        if not math.isfinite(self.logit_mean):
            raise ValueError(f"logit_mean must be a finite number, got {self.logit_mean}")
        if not (math.isfinite(self.logit_std) and self.logit_std > 0):
            raise ValueError(f"logit_std must be > 0, got {self.logit_std}")
        if not 0.0 <= self.unmasked_weight <= 1.0:
            raise ValueError(f"unmasked_weight must be in 0..1, got {self.unmasked_weight}")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise ValueError(f"shift must be > 0 (1 = no shift), got {self.shift}")
        low, high = self.sigma_range
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"sigma_range must be low-high with 0 <= low < high <= 1, got {low:g}-{high:g}")


def parse_sigma_range(text: str) -> tuple[float, float] | None:
    """'low-high' (e.g. '0.875-1') → (low, high); 'auto' → None. Raises a ValueError naming the fix."""
    if text == "auto":
        return None
    try:
        low, high = (float(part) for part in text.replace(" ", "").split("-"))
    except ValueError:
        raise ValueError(f"sigma_range must be 'auto' or 'low-high' such as '0.875-1', got {text!r}") from None
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(f"sigma_range must be low-high with 0 <= low < high <= 1, got {text!r}")
    return low, high


def shift_sigmas(sigmas: np.ndarray, shift: float) -> np.ndarray:
    """Static (SD3/ComfyUI time_snr_shift) shift: s·σ / (1 + (s-1)·σ)."""
    return shift * sigmas / (1.0 + (shift - 1.0) * sigmas)


def sample_sigmas(rng: np.random.Generator, n: int, settings: ObjectiveSettings, image_tokens: int) -> np.ndarray:
    """n sigmas in (0,1), float32 [n], from exactly one rng.random(n)."""
    u = rng.random(n)  # float64 [n]
    biased = _BIASES[settings.content_or_style](u)
    sigmas = _SAMPLERS[settings.sampling](biased, settings)
    sigmas = shift_sigmas(sigmas, _SHIFTS[settings.shift_mode](settings, image_tokens))
    low, high = settings.sigma_range
    if (low, high) != (0.0, 1.0):  # the whole distribution squeezed into the range, as musubi-tuner's
        sigmas = low + (high - low) * sigmas  # min/max_timestep do: every draw lands inside, none is redrawn
    return np.clip(sigmas, SIGMA_MIN, SIGMA_MAX).astype(np.float32)


def loss_weights(sigmas: np.ndarray, weighting: str) -> np.ndarray:
    """Per-sample loss weight for each sigma, float32 [n]."""
    _check_choice("loss_weighting", weighting, LOSS_WEIGHTINGS)
    sigmas = np.asarray(sigmas, dtype=np.float64)
    return _WEIGHTINGS[weighting](sigmas).astype(np.float32)


@dataclass
class Draws:
    """Everything random about one training step."""

    noise: np.ndarray  # float32 [B,C,H,W] or a video's [B,C,T,H,W], ε
    sigmas: np.ndarray  # float32 [B], in (0,1)
    weights: np.ndarray  # float32 [B], multiplies each sample's loss
    drop_caption: np.ndarray  # bool [B], True → use the cached empty-caption embedding


def draw(
    rng: np.random.Generator,
    latent_shape: tuple,
    settings: ObjectiveSettings,
    caption_dropout: float,
    image_tokens: int | None = None,
) -> Draws:
    """Draw one step's randomness in a fixed order: sigmas, noise, caption dropout.

    image_tokens defaults to (T·)H·W of the latent (Flux2: one token per latent cell); pass
    the real count for archs that patchify inside the model (Z-Image: H·W/4).
    """
    if len(latent_shape) not in (4, 5):
        raise ValueError(f"latent_shape must be [B,C,H,W] or a video's [B,C,T,H,W], got {tuple(latent_shape)}")
    if not 0.0 <= caption_dropout <= 1.0:
        raise ValueError(f"caption_dropout must be in 0..1, got {caption_dropout}")
    batch = int(latent_shape[0])
    tokens = image_tokens if image_tokens is not None else math.prod(int(n) for n in latent_shape[2:])
    # The order never changes and every draw happens even when unused (caption_dropout
    # = 0), so the generator's position after a step depends only on the shapes: resume
    # and the torch/MLX backends stay in lockstep.
    sigmas = sample_sigmas(rng, batch, settings, tokens)
    noise = rng.standard_normal(tuple(latent_shape), dtype=np.float32)
    drop_caption = rng.random(batch) < caption_dropout
    return Draws(
        noise=noise, sigmas=sigmas, weights=loss_weights(sigmas, settings.loss_weighting), drop_caption=drop_caption
    )


def interpolate(x0, noise, sigmas):
    """x_t = (1-σ)·x0 + σ·ε for numpy, torch or mlx arrays of one kind; σ [B] broadcast."""
    sigma = sigmas.reshape((-1,) + (1,) * (len(x0.shape) - 1))  # [B,1,1,...]
    return (1.0 - sigma) * x0 + sigma * noise


def velocity_target(x0, noise):
    """v = ε - x0, what the model is trained to predict."""
    return noise - x0
