"""Trigger word, prefix, suffix and seeded tag shuffling."""

import numpy as np

from trainer.data.captions import CaptionSettings, caption_variants, shuffle_tags

KEY = "0123456789abcdef" * 4


def one(raw, **kw):
    return caption_variants(raw, CaptionSettings(**kw), seed=0, key=KEY)[0]


def test_trigger_placeholder_prepend_and_no_duplicate():
    assert one("a photo of {trigger} smiling", trigger_word="ohwx") == "a photo of ohwx smiling"
    assert one("a photo of a man", trigger_word="ohwx") == "ohwx, a photo of a man"
    assert one("ohwx man at the beach", trigger_word="ohwx") == "ohwx man at the beach"
    assert one("ohwxyz at the beach", trigger_word="ohwx") == "ohwx, ohwxyz at the beach"  # word boundary


def test_missing_and_empty_caption_fall_back():
    assert one(None, trigger_word="ohwx") == "ohwx"
    assert one("", default_caption="a photo of {trigger}", trigger_word="sks") == "a photo of sks"
    assert one(None) == ""
    assert one("{trigger} walking") == "walking"  # no trigger word: placeholder dropped


def test_prefix_suffix():
    assert one("red hat", trigger_word="t", prefix="photo,", suffix=", 35mm") == "photo, t, red hat, 35mm"


def test_shuffle_keeps_head_and_is_seeded():
    rng = np.random.default_rng(1)
    out = shuffle_tags("a, b, c, d, e, f", 2, rng)
    assert out.startswith("a, b, ") and sorted(out.split(", ")) == list("abcdef")
    s = CaptionSettings(trigger_word="tw", shuffle_tags=True, keep_tags=1, variants=5)
    v1 = caption_variants("one, two, three, four, five", s, seed=7, key=KEY)
    v2 = caption_variants("one, two, three, four, five", s, seed=7, key=KEY)
    assert v1 == v2 and v1[0] == "tw, one, two, three, four, five" and 2 <= len(v1) <= 5
    assert all(v.startswith("tw, one, ") for v in v1)
    assert len(set(v1)) == len(v1)
    assert caption_variants("no tags here", s, seed=7, key=KEY) == ["tw, no tags here"]
