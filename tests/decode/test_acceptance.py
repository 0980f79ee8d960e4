import pytest
import torch

from marslm.decode import check_tau
from marslm.decode.acceptance import accept_length, confidence
from marslm.decode.params import ENTROPY, MARGIN, PROB, one_token_rows
from marslm.errors import UserError


def _accept(conf, tau, metric=PROB, max_accept=None):
    conf = torch.tensor(conf, dtype=torch.float32)
    rows = conf.shape[0]
    tau = torch.full((rows,), tau, dtype=torch.float64) if isinstance(tau, float) else torch.tensor(tau)
    metric = torch.full((rows,), metric, dtype=torch.long)
    return accept_length(conf, tau, metric, max_accept).tolist()


def test_accepts_the_ar_token_then_the_leading_confident_masks():
    assert _accept([[0.99, 0.97, 0.5, 0.99]], 0.95) == [2]
    assert _accept([[0.99, 0.99, 0.99, 0.99]], 0.95) == [4]
    # the reference rule: the first (AR) candidate is accepted whatever its confidence, and the
    # masks after it still count; a pass after a failed mask does not
    assert _accept([[0.2, 0.99, 0.99, 0.99]], 0.95) == [4]
    assert _accept([[0.2, 0.99, 0.2, 0.99]], 0.95) == [2]
    assert _accept([[0.99, 0.2, 0.99, 0.99]], 0.95) == [1]
    assert _accept([[9.0, 0.1, 0.1, 9.0]], 0.5, metric=ENTROPY) == [3]


def test_one_token_mode_accepts_exactly_one_even_when_prob_rounds_to_one():
    assert _accept([[1.0, 1.0, 1.0, 1.0]], 1.0) == [1]
    assert _accept([[0.0, 0.0, 0.0]], 0.0, metric=ENTROPY) == [1]
    assert one_token_rows(
        torch.tensor([1.0, 0.9, 0.0, 0.5]), torch.tensor([PROB, PROB, ENTROPY, ENTROPY])
    ).tolist() == [True, False, True, False]


def test_entropy_accepts_while_below_tau_and_margin_while_above():
    assert _accept([[0.1, 0.2, 0.9, 0.1]], 0.5, metric=ENTROPY) == [2]
    assert _accept([[0.8, 0.7, 0.1]], 0.5, metric=MARGIN) == [2]


def test_per_row_tau_and_cap():
    assert _accept([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]], [0.8, 0.95]) == [3, 1]
    assert _accept([[0.9, 0.9, 0.9], [0.9, 0.9, 0.9]], 0.5, max_accept=torch.tensor([2, 3])) == [2, 3]


def test_confidence_metrics():
    logits = torch.log(torch.tensor([[[0.7, 0.2, 0.1], [0.4, 0.5, 0.1]]]))
    for code, expected in [(PROB, [0.7, 0.5]), (MARGIN, [0.5, 0.1])]:
        tokens, conf = confidence(logits, torch.tensor([code]))
        assert tokens.tolist() == [[0, 1]]
        assert conf[0].tolist() == pytest.approx(expected, abs=1e-6)
    _, ent = confidence(logits, torch.tensor([ENTROPY]))
    p = torch.tensor([0.7, 0.2, 0.1])
    assert float(ent[0, 0]) == pytest.approx(float(-(p * p.log()).sum()), abs=1e-6)


@pytest.mark.parametrize(
    "tau,metric", [(0.0, "prob"), (1.5, "prob"), (-0.1, "margin"), (-1.0, "entropy"), (0.9, "nope")]
)
def test_bad_tau_is_refused(tau, metric):
    with pytest.raises(UserError):
        check_tau(tau, metric)


@pytest.mark.parametrize("tau,metric", [(1.0, "prob"), (0.5, "margin"), (0.0, "entropy"), (3.0, "entropy")])
def test_good_tau_is_accepted(tau, metric):
    check_tau(tau, metric)
