"""trainer/objective/flow.py: each sampler against its formula, shifts, weights, draws, algebra."""

import ast
import math
from statistics import NormalDist

import numpy as np
import pytest

from trainer.objective import flow as obj
from trainer.objective.flow import ObjectiveSettings

SEED = 1234


def _rngs():
    """Two generators in the same state: one for the code, one for the expected value."""
    return np.random.default_rng(SEED), np.random.default_rng(SEED)


def _sample(n=512, tokens=4096, **settings):
    return obj.sample_sigmas(np.random.default_rng(SEED), n, ObjectiveSettings(**settings), tokens)


def test_objective_imports_no_torch_or_mlx():
    tree = ast.parse(open(obj.__file__, encoding="utf-8").read())
    roots = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    roots |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert not roots & {"torch", "mlx"}, roots


def test_uniform_is_the_uniform_draw_itself():
    rng, ref = _rngs()
    sigmas = obj.sample_sigmas(rng, 64, ObjectiveSettings(), 4096)
    expected = np.clip(ref.random(64), obj.SIGMA_MIN, obj.SIGMA_MAX).astype(np.float32)
    assert sigmas.dtype == np.float32 and sigmas.shape == (64,)
    np.testing.assert_array_equal(sigmas, expected)


@pytest.mark.parametrize("mode, to_sigma", [("content", lambda u: 1 - u**3), ("style", lambda u: u**3)])
def test_content_and_style_bias_the_uniform(mode, to_sigma):
    rng, ref = _rngs()
    sigmas = obj.sample_sigmas(rng, 64, ObjectiveSettings(content_or_style=mode), 4096)
    expected = np.clip(to_sigma(ref.random(64)), obj.SIGMA_MIN, obj.SIGMA_MAX).astype(np.float32)
    np.testing.assert_array_equal(sigmas, expected)


def test_content_favours_high_noise_and_style_low():
    assert _sample(20_000, content_or_style="content").mean() > 0.7  # E[1-u³] = 0.75
    assert _sample(20_000, content_or_style="style").mean() < 0.3  # E[u³] = 0.25
    assert abs(_sample(20_000).mean() - 0.5) < 0.01


def test_logit_normal_matches_inverse_cdf_formula():
    rng, ref = _rngs()
    settings = ObjectiveSettings(sampling="logit_normal", logit_mean=0.3, logit_std=1.2)
    sigmas = obj.sample_sigmas(rng, 64, settings, 4096)
    logits = [0.3 + 1.2 * NormalDist().inv_cdf(u) for u in ref.random(64)]
    expected = np.array([1 / (1 + math.exp(-x)) for x in logits], dtype=np.float32)
    np.testing.assert_allclose(sigmas, expected, rtol=1e-6, atol=0)


def test_logit_normal_median_is_sigmoid_of_mean():
    sigmas = _sample(20_000, sampling="logit_normal", logit_mean=0.8, logit_std=1.0)
    assert abs(np.median(sigmas) - 1 / (1 + math.exp(-0.8))) < 0.01
    assert 0.0 < sigmas.min() and sigmas.max() < 1.0


def test_static_shift_formula_and_sampling():
    sigmas = np.array([0.1, 0.5, 0.9])
    np.testing.assert_allclose(obj.shift_sigmas(sigmas, 3.0), 3 * sigmas / (1 + 2 * sigmas))
    np.testing.assert_array_equal(obj.shift_sigmas(sigmas, 1.0), sigmas)
    rng, ref = _rngs()
    shifted = obj.sample_sigmas(rng, 64, ObjectiveSettings(shift_mode="static", shift=3.0), 4096)
    u = ref.random(64)
    np.testing.assert_allclose(shifted, (3 * u / (1 + 2 * u)).astype(np.float32), rtol=1e-6)


def test_resolution_shift_matches_musubi_flux2_shift():
    # musubi flux2_shift: mu = 0.5 at 256 tokens, 1.15 at 4096 (a 1024² Flux2 image).
    assert obj.resolution_shift(256) == pytest.approx(math.exp(0.5))
    assert obj.resolution_shift(4096) == pytest.approx(math.exp(1.15))
    assert obj.resolution_shift(1024) == pytest.approx(1.8776106, rel=1e-6)  # 512² image


def test_resolution_shift_equals_flux2_empirical_mu_at_many_steps():
    # diffusers/ComfyUI compute_empirical_mu, num_steps ≥ 200 branch: a2·tokens + b2.
    for tokens in (1024, 2500, 4096, 9000):
        assert math.log(obj.resolution_shift(tokens)) == pytest.approx(0.00016927 * tokens + 0.45666666, abs=1e-5)


def test_resolution_shift_is_monotone_and_used_by_sampler():
    shifts = [obj.resolution_shift(t) for t in (64, 256, 1024, 4096, 16384)]
    assert all(a < b for a, b in zip(shifts, shifts[1:]))
    settings = dict(shift_mode="resolution")
    assert _sample(tokens=4096, **settings).mean() > _sample(tokens=256, **settings).mean()
    rng, ref = _rngs()
    got = obj.sample_sigmas(rng, 64, ObjectiveSettings(shift_mode="resolution", shift=9.0), 1024)
    expected = obj.shift_sigmas(ref.random(64), obj.resolution_shift(1024)).astype(np.float32)
    np.testing.assert_allclose(got, expected, rtol=1e-6)  # settings.shift is ignored


def test_sigmas_never_reach_zero_or_one():
    class Extremes:
        def random(self, n):
            return np.array([0.0, 1.0 - 2**-53])  # the extremes rng.random can return

    for settings in (
        ObjectiveSettings(),
        ObjectiveSettings(sampling="logit_normal", logit_std=5.0),
        ObjectiveSettings(content_or_style="content"),
    ):
        sigmas = obj.sample_sigmas(Extremes(), 2, settings, 4096)
        assert np.all(sigmas > 0) and np.all(sigmas < 1)


def test_bell_weights_mean_one_peak_half_symmetric_nonnegative():
    grid = (np.arange(100_000) + 0.5) / 100_000  # midpoints of a fine uniform grid on (0,1)
    weights = obj.loss_weights(grid, "bell")
    assert weights.dtype == np.float32
    assert weights.mean() == pytest.approx(1.0, abs=1e-5)
    assert np.all(weights >= 0)
    np.testing.assert_allclose(weights, weights[::-1], atol=1e-6)
    assert obj.loss_weights(np.array([0.5]), "bell")[0] == weights.max()


def test_bell_matches_ai_toolkit_linear_timesteps_table():
    # ostris/ai-toolkit toolkit/samplers/custom_flowmatch_sampler.py, rebuilt here.
    i = np.arange(1000, dtype=np.float64)
    y = np.exp(-2 * ((i - 500) / 1000) ** 2)
    table = (y - y.min()) * (1000 / (y - y.min()).sum())
    sigmas = np.linspace(1000, 1, 1000) / 1000  # its timesteps, index 0 = highest noise
    np.testing.assert_allclose(obj.loss_weights(sigmas, "bell"), table, atol=5e-3)


def test_no_weighting_is_ones():
    np.testing.assert_array_equal(obj.loss_weights(np.array([0.1, 0.9]), "none"), np.ones(2, np.float32))


def test_draw_is_deterministic_and_in_documented_order():
    settings = ObjectiveSettings(sampling="logit_normal", loss_weighting="bell", shift_mode="resolution")
    shape = (3, 4, 6, 8)
    rng, ref = _rngs()
    draws = obj.draw(rng, shape, settings, caption_dropout=0.5)
    again = obj.draw(np.random.default_rng(SEED), shape, settings, caption_dropout=0.5)
    for name in ("noise", "sigmas", "weights", "drop_caption"):
        np.testing.assert_array_equal(getattr(draws, name), getattr(again, name))
    # The order: sigmas (one random(n)), noise, caption dropout.
    np.testing.assert_array_equal(draws.sigmas, obj.sample_sigmas(ref, 3, settings, 6 * 8))
    np.testing.assert_array_equal(draws.noise, ref.standard_normal(shape, dtype=np.float32))
    np.testing.assert_array_equal(draws.drop_caption, ref.random(3) < 0.5)
    np.testing.assert_array_equal(draws.weights, obj.loss_weights(draws.sigmas, "bell"))
    assert draws.noise.dtype == np.float32 and draws.drop_caption.dtype == np.bool_
    assert rng.random() == ref.random()  # both generators end in the same place


def test_draw_consumes_dropout_draw_even_when_off():
    rng_off, rng_on = _rngs()
    obj.draw(rng_off, (2, 1, 2, 2), ObjectiveSettings(), caption_dropout=0.0)
    obj.draw(rng_on, (2, 1, 2, 2), ObjectiveSettings(), caption_dropout=1.0)
    assert rng_off.random() == rng_on.random()


def test_draw_image_tokens_override():
    settings = ObjectiveSettings(shift_mode="resolution")
    rng, ref = _rngs()
    draws = obj.draw(rng, (4, 16, 64, 64), settings, 0.0, image_tokens=1024)
    np.testing.assert_array_equal(draws.sigmas, obj.sample_sigmas(ref, 4, settings, 1024))


def test_caption_dropout_extremes():
    shape = (16, 1, 2, 2)
    assert not obj.draw(np.random.default_rng(0), shape, ObjectiveSettings(), 0.0).drop_caption.any()
    assert obj.draw(np.random.default_rng(0), shape, ObjectiveSettings(), 1.0).drop_caption.all()


def test_interpolate_and_velocity_algebra_numpy():
    rng = np.random.default_rng(0)
    x0, noise = rng.standard_normal((2, 3, 4, 5, 6), dtype=np.float32)
    sigmas = np.array([0.1, 0.5, 0.99], dtype=np.float32)
    x_t = obj.interpolate(x0, noise, sigmas)
    v = obj.velocity_target(x0, noise)
    np.testing.assert_allclose(x_t - sigmas[:, None, None, None] * v, x0, atol=1e-5)
    np.testing.assert_allclose(x_t[1], 0.5 * x0[1] + 0.5 * noise[1], atol=1e-6)


def test_interpolate_and_velocity_algebra_torch():
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(2, 3, 4, 5, 6, generator=gen)
    sigmas = torch.tensor([0.1, 0.5, 0.99])
    x_t = obj.interpolate(x0, noise, sigmas)
    v = obj.velocity_target(x0, noise)
    assert isinstance(x_t, torch.Tensor) and x_t.shape == x0.shape
    torch.testing.assert_close(x_t - sigmas.view(-1, 1, 1, 1) * v, x0, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "field, value",
    [
        ("sampling", "sigmoid"),
        ("content_or_style", "both"),
        ("shift_mode", "auto"),
        ("loss_weighting", "weighted"),
    ],
)
def test_bad_choice_names_field_value_and_options(field, value):
    with pytest.raises(ValueError) as err:
        ObjectiveSettings(**{field: value})
    message = str(err.value)
    assert field in message and repr(value) in message
    assert all(
        option in message
        for option in getattr(
            obj,
            {
                "sampling": "SAMPLINGS",
                "content_or_style": "CONTENT_OR_STYLE",
                "shift_mode": "SHIFT_MODES",
                "loss_weighting": "LOSS_WEIGHTINGS",
            }[field],
        )
    )


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(logit_std=0.0), "logit_std"),
        (dict(shift=-1.0), "shift"),
        (dict(logit_mean=math.nan), "logit_mean"),
    ],
)
def test_bad_numbers_rejected(kwargs, name):
    with pytest.raises(ValueError, match=name):
        ObjectiveSettings(**kwargs)


def test_bad_draw_arguments_rejected():
    with pytest.raises(ValueError, match="caption_dropout"):
        obj.draw(np.random.default_rng(0), (1, 1, 2, 2), ObjectiveSettings(), 1.5)
    with pytest.raises(ValueError, match="latent_shape"):
        obj.draw(np.random.default_rng(0), (1, 2, 2), ObjectiveSettings(), 0.0)
    with pytest.raises(ValueError, match="loss_weighting"):
        obj.loss_weights(np.array([0.5]), "snr")
    with pytest.raises(ValueError, match="image_tokens"):
        obj.resolution_shift(0)


# --- sigma_range: a Wan 2.2 expert's side of the boundary (trainer/archs/wan.py) ---------------------------


@pytest.mark.parametrize("sigma_range", [(0.875, 1.0), (0.0, 0.875), (0.9, 1.0), (0.2, 0.4)])
@pytest.mark.parametrize("sampling", ["uniform", "logit_normal"])
def test_sigma_range_keeps_every_draw_inside_it(sigma_range, sampling):
    low, high = sigma_range
    sigmas = _sample(4096, sampling=sampling, shift_mode="static", shift=8.0, sigma_range=sigma_range)
    assert sigmas.min() >= np.float32(low) and sigmas.max() <= np.float32(high)
    assert sigmas.max() - sigmas.min() > 0.5 * (high - low)  # spread over the range, not stuck at an end
    full = _sample(4096, sampling=sampling, shift_mode="static", shift=8.0)  # the same draws, squeezed
    np.testing.assert_allclose(sigmas, np.clip(low + (high - low) * full, obj.SIGMA_MIN, obj.SIGMA_MAX), atol=1e-6)


def test_sigma_range_default_changes_no_draw():
    np.testing.assert_array_equal(_sample(256, sigma_range=(0.0, 1.0)), _sample(256))


@pytest.mark.parametrize("text, parsed", [("auto", None), ("0.875-1", (0.875, 1.0)), (" 0 - 0.9 ", (0.0, 0.9))])
def test_parse_sigma_range(text, parsed):
    assert obj.parse_sigma_range(text) == parsed


@pytest.mark.parametrize("text", ["0.9-0.1", "1", "a-b", "0-1.5", "0.5-0.5"])
def test_bad_sigma_range_names_the_form(text):
    with pytest.raises(ValueError, match="sigma_range"):
        obj.parse_sigma_range(text)


def test_expert_archs_set_the_config_default():
    from trainer import config
    from trainer.archs import get_arch
    from trainer.run.loop import objective_settings

    high = objective_settings(config.from_dict({"arch": "wan22_t2v_high"}), get_arch("wan22_t2v_high"))
    low = objective_settings(config.from_dict({"arch": "wan22_i2v_low"}), get_arch("wan22_i2v_low"))
    assert high.sigma_range == (0.875, 1.0) and low.sigma_range == (0.0, 0.9)
    given = config.from_dict({"arch": "wan22_t2v_high", "sigma_range": "0.5-1"})
    assert objective_settings(given, get_arch("wan22_t2v_high")).sigma_range == (0.5, 1.0)
    with pytest.raises(config.ConfigError, match="sigma_range"):
        config.from_dict({"sigma_range": "high"})


def test_video_latents_draw_noise_of_their_shape_and_count_every_frame():
    rng, ref = _rngs()
    draws = obj.draw(rng, (2, 16, 3, 4, 6), ObjectiveSettings(shift_mode="resolution"), 0.0)
    assert draws.noise.shape == (2, 16, 3, 4, 6)
    expected = obj.sample_sigmas(ref, 2, ObjectiveSettings(shift_mode="resolution"), 3 * 4 * 6)
    np.testing.assert_array_equal(draws.sigmas, expected)  # tokens default: T·H·W
    with pytest.raises(ValueError, match="B,C,T,H,W"):
        obj.draw(rng, (2, 16, 4), ObjectiveSettings(), 0.0)
