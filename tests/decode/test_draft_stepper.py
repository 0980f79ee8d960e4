"""The draft-model decoder a step at a time (draft_model.py's ``DraftedRow``): what each step adds
is ``run_row``'s answer, piece by piece, and a new tau reaches a running row from its next step."""

from dataclasses import replace

import pytest

from marslm.chat import stop_token_ids
from marslm.decode import DecodingParams
from marslm.decode.draft_model import DraftModelDecoder, make_drafter
from marslm.modeling import checkpoint_facts


def decoder_for(target, draft, k: int = 3) -> DraftModelDecoder:
    model, tokenizer = target
    facts = checkpoint_facts(model, tokenizer)
    return DraftModelDecoder(
        model,
        make_drafter((draft, None), tokenizer, None, True),
        k,
        mask_token_id=facts.mask_token_id,
        stop_ids=stop_token_ids(tokenizer, model.generation_config),
        use_last_mask=True,
    )


@pytest.mark.parametrize("setting", [dict(tau=1.0), dict(tau=0.6), dict(tau=0.8, temperature=0.8, seed=5)])
def test_the_steps_add_up_to_run_row(trained_checkpoints, prompts, setting):
    target, draft = trained_checkpoints["mars64"], trained_checkpoints["ar64"][0]
    params = DecodingParams(max_new_tokens=120, **setting).validate(4)
    rows = [decoder_for(target, draft).run_row(p, params, i) for i, p in enumerate(prompts)]
    assert any(r.stopped for r in rows) and any(max(r.accepted_per_step) > 1 for r in rows)
    decoder = decoder_for(target, draft)  # one decoder, its drafter reset for each row
    for i, (prompt, expected) in enumerate(zip(prompts, rows)):
        row, pieces = decoder.start_row(prompt, params, i), []
        while not row.finished:
            pieces.append(row.step())
        assert [t for piece in pieces for t in piece] == expected.token_ids
        assert [len(p) for p in pieces[:-1]] == expected.accepted_per_step[:-1]  # the last may hold the stop token
        assert row.result() == expected


def test_a_new_tau_applies_from_the_next_step(trained_checkpoints, prompts):
    target, draft = trained_checkpoints["mars64"], trained_checkpoints["ar64"][0]
    decoder = decoder_for(target, draft, k=1)
    params = DecodingParams(max_new_tokens=60, tau=1.0).validate(4)
    row = decoder.start_row(prompts[0], params, 0)
    row.step()
    assert row.accepted_per_step[0] <= 2  # at tau 1: at most the one draft and the target's token
    row.params = replace(params, tau=0.5)
    while not row.finished:
        row.step()
    assert max(row.accepted_per_step) > 2  # masks read after the change reach past K + 1
