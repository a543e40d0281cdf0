"""A batch of another length than the plan's (NOTE [A batch of another length] in memo/session.py).

A variable-length loader gives batches shorter than the one the plan was made for: such a step runs
outside the plan as a whole (every allocation from memo's fallback pool, none a deviation), said
once and counted, with the unwrapped model's loss and gradients; the planned steps around it still
hit every planned request.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import memo
from memo.models import build_model
from memo.pipeline import profile
from tests.grads import rel_err

pytestmark = pytest.mark.usefixtures("one_thread")

SEQ = 512


def test_a_shorter_batch_runs_outside_the_plan_and_the_planned_steps_stay_planned() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = profile("llama-tiny", SEQ, 1, "float32", "cpu", time_limit=2.0, recorder="allocator").plan
    model = build_model("llama-tiny")
    reference = copy.deepcopy(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, vocab, (1, n), generator=gen) for n in (SEQ, SEQ // 2, SEQ, 3 * SEQ // 4)]
    hits = []
    with memo.Session(model, plan, example=(batches[0], batches[0])) as session:
        for k, ids in enumerate(batches):
            model.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            if k == 1:
                said = r"this batch is \[1, 256\] tokens, the plan was made for \[1, 512\].*said once"
                with pytest.warns(UserWarning, match=said):
                    loss = session.step(ids, ids)
            else:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", UserWarning)  # the second shorter batch: not again
                    loss = session.step(ids, ids)
            want = reference(ids, ids)
            want.backward()
            assert float(loss) == pytest.approx(float(want), rel=1e-5)
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                assert rel_err(p.grad, q.grad) < 1e-5
            stats = memo.allocator.stats()
            assert stats["deviations"] == 0, (ids.shape, stats)
            hits.append(stats["planned_hits"])
    assert session.off_plan_steps == 2
    per_step = hits[0]
    assert per_step > 0 and hits == [per_step, per_step, 2 * per_step, 2 * per_step]
