"""Select methods on mock logprobs (SGLang's test_choices case) and via a fake backend."""
import math

import pytest

from sglite.frontend.choices import (greedy_token_selection, resolve_choices_method, token_length_normalized,
                                     unconditional_likelihood_normalized)

# "organ" = [organ], "organism" = [organ, ism], the long word = 8 tokens (as in SGLang's test)
MOCK = {
    "choices": ["organ", "organism", "antidisestablishmentarianism"],
    "normalized_prompt_logprobs": [-0.1, -0.2, -0.05],
    "input_token_logprobs": [
        [[-0.1, 1, None]],
        [[-0.1, 1, None], [-0.3, 2, None]],
        [[-0.4, 3, None], [-0.25, 4, None], [-0.1, 5, None], [-0.01, 6, None], [-0.01, 7, None],
         [-0.01, 8, None], [-0.01, 9, None], [-0.01, 2, None]],
    ],
    "output_token_logprobs": [[[-0.1, 10, None]]] * 3,
    "unconditional_token_logprobs": [
        [[None, 1, None]],
        [[None, 1, None], [-1.4, 2, None]],
        [[None, 3, None], [-0.25, 4, None], [-0.1, 5, None], [-0.01, 6, None], [-0.01, 7, None],
         [-0.01, 8, None], [-0.01, 9, None], [-0.01, 2, None]],
    ],
}


def test_token_length_normalized_picks_long_word():
    d = token_length_normalized(**MOCK)
    assert d.decision == "antidisestablishmentarianism"
    assert d.meta_info["normalized_prompt_logprobs"] == [-0.1, -0.2, -0.05]


def test_greedy_picks_organ_and_pads_with_mean():
    d = greedy_token_selection(**MOCK)
    assert d.decision == "organ"
    m = d.meta_info["greedy_logprob_matrix"]
    assert m[0] == pytest.approx([-0.1] * 8)
    assert m[1] == pytest.approx([-0.1, -0.3] + [-0.2] * 6)
    assert m[2][:3] == pytest.approx([-0.4, -0.25, -0.1])


def test_unconditional_picks_organism():
    d = unconditional_likelihood_normalized(**MOCK)
    assert d.decision == "organism"
    assert d.meta_info["normalized_unconditional_prompt_logprobs"] == pytest.approx([-0.1, 0.5, -0.05], abs=1e-6)


def test_unconditional_needs_data_and_equal_lengths():
    with pytest.raises(ValueError, match="unconditional"):
        unconditional_likelihood_normalized(**{**MOCK, "unconditional_token_logprobs": None})
    bad = [MOCK["unconditional_token_logprobs"][0], [[None, 1, None]], MOCK["unconditional_token_logprobs"][2]]
    with pytest.raises(ValueError, match="same length"):
        unconditional_likelihood_normalized(**{**MOCK, "unconditional_token_logprobs": bad})


def test_ties_pick_first():
    data = {"choices": ["b", "a", "c"], "normalized_prompt_logprobs": [-1.0, -1.0, -2.0],
            "input_token_logprobs": [[[-1.0, 1, None]], [[-1.0, 2, None]], [[-2.0, 3, None]]],
            "output_token_logprobs": [[], [], []],
            "unconditional_token_logprobs": [[[None, 1, None]], [[None, 2, None]], [[None, 3, None]]]}
    assert token_length_normalized(**data).decision == "b"
    assert greedy_token_selection(**data).decision == "b"
    assert unconditional_likelihood_normalized(**data).decision == "b"


def test_resolve_by_name_and_unknown():
    assert resolve_choices_method("greedy_token_selection") is greedy_token_selection
    assert resolve_choices_method(None) is token_length_normalized
    with pytest.raises(ValueError, match="token_length_normalized"):
        resolve_choices_method("best")


def test_select_on_fake_backend_uses_mean_logprob_and_exposes_meta():
    import sglite
    from sglite.frontend.testing import FakeBackend

    lps = {"apple pie": [-1.0, -1.0], "apple tart": [-1.0, -0.2], "applesauce": [-3.0]}
    fb = FakeBackend(score_fn=lambda prompt, c: lps[c])

    @sglite.function
    def prog(s, method):
        s += "Dessert: " + sglite.select("d", choices=list(lps), choices_method=method)

    st = prog.run(method="token_length_normalized", backend=fb)
    assert st["d"] == "apple tart"
    assert st.text() == "Dessert: apple tart"
    meta = st.get_meta_info("d")
    assert meta["normalized_prompt_logprobs"] == pytest.approx([-1.0, -0.6, -3.0])
    assert not any(math.isnan(x) for x in meta["normalized_prompt_logprobs"])
    assert prog.run(method="greedy_token_selection", backend=fb)["d"] == "apple tart"
    st = prog.run(method="unconditional_likelihood_normalized", backend=fb)
    assert st["d"] in lps
    assert fb.calls("score")[-1]["unconditional"] is True
    assert "normalized_unconditional_prompt_logprobs" in st.get_meta_info("d")
