"""``sglite eval perplexity``: windows, the text slice, and the engine's perplexity against HF
transformers' own strided computation (fp32, tiny random model)."""
import math

import pytest

from sglite.eval import perplexity as ppl


def test_windows_score_every_position_once():
    for n, ctx, stride in [(10, 4, 2), (10, 4, 4), (7, 16, 8), (100, 32, 5), (2, 2, 1)]:
        seen = []
        for b, e, f in ppl.windows(n, ctx, stride):
            assert e - b <= ctx and b < f < e or (b == 0 and 0 < f < e)
            seen.extend(range(f, e))
        starts = {b for b, _, _ in ppl.windows(n, ctx, stride)} if stride == ctx else set()
        assert seen == [p for p in range(1, n) if p not in starts]


def test_windows_bad_arguments():
    with pytest.raises(ValueError, match="stride"):
        ppl.windows(10, 4, 5)
    with pytest.raises(ValueError, match="context_length"):
        ppl.windows(10, 1, 1)


def test_text_slice_is_a_fixed_prefix(real_tokenizer):
    a = ppl.text_token_ids(real_tokenizer, 300)
    b = ppl.text_token_ids(real_tokenizer, 600)
    assert len(a) == 300 and b[:300] == a
    assert real_tokenizer.decode(a).startswith('The "assert" statement')
    with pytest.raises(ValueError, match="max_tokens"):
        ppl.text_token_ids(real_tokenizer, 1)


def _hf_perplexity(model_dir, ids, ctx, stride):
    """HF transformers' strided perplexity recipe (labels -100 on the context part), fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    t = torch.tensor([ids])
    nll_sum, n_tok, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + ctx, len(ids))
        trg = end - prev_end
        x = t[:, begin:end]
        labels = x.clone()
        labels[:, :-trg] = -100
        with torch.no_grad():
            loss = m(x, labels=labels).loss
        valid = int((labels[:, 1:] != -100).sum())
        nll_sum += float(loss) * valid
        n_tok += valid
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll_sum / n_tok), n_tok


def test_engine_perplexity_matches_hf(tiny_model_dir, real_tokenizer):
    from sglite import Engine

    ids = ppl.text_token_ids(real_tokenizer, 160)
    want, n = _hf_perplexity(tiny_model_dir, ids, 48, 20)
    with Engine(model_path=str(tiny_model_dir), dtype="float32", max_total_tokens=4096) as e:
        got = ppl.perplexity(e, ids, context_length=48, stride=20)
    assert got.n_scored == n == len(ids) - 1
    assert got.perplexity == pytest.approx(want, rel=1e-4)
    assert got.n_windows == len(ppl.windows(160, 48, 20))


def test_cli_rejects_bad_stride_before_loading(capsys):
    from sglite.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["eval", "perplexity", "--window-length", "8", "--stride", "9"])
    assert exc.value.code == 2
    assert "stride" in capsys.readouterr().err
