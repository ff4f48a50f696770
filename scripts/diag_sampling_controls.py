"""Why the penalised-batch negative controls of tests/test_sampling.py fail on CPU (p ~ 1e-16) but not on CUDA:
runs each plant on the test's model and prints min p-value, acceptance, and what PrefixProcessor saw.
    SELFSPEC_TEST_DEVICE=cuda python scripts/diag_sampling_controls.py"""
import collections
import os
import sys

sys.path.insert(0, "tests")
import torch  # noqa: E402

if os.environ.get("SELFSPEC_TEST_DEVICE", "cpu") != "cpu":
    torch.set_default_device(os.environ["SELFSPEC_TEST_DEVICE"])
import pytest  # noqa: E402

import selfspec.decoding  # noqa: E402
import selfspec.processing  # noqa: E402
import test_sampling as T  # noqa: E402

seen = collections.Counter()
orig_call = selfspec.processing.PrefixProcessor.__call__


def spy(self, seq, lengths, logits):
    seen[(logits.shape[1], tuple(sorted(set(lengths.tolist())))[:3], str(seq.device))] += 1
    return orig_call(self, seq, lengths, logits)


mp = pytest.MonkeyPatch()
model = T._tiny_model()
print("model", next(model.parameters()).device, next(model.parameters()).dtype)
exact = [T.exact_marginals(model, torch.tensor([p]), T.STEPS, T.PENALTY_PROCESSORS) for p in T.PROMPTS]
for plant, lazy in [(None, False), (T._drafts_left_out_of_the_prefix, False), (T._column_offsets_dropped, True)]:
    seen.clear()
    mp.setattr(selfspec.decoding, "lazy_processing", lambda state: lazy)
    mp.setattr(selfspec.processing.PrefixProcessor, "__call__", spy)
    if plant:
        plant(mp)
    pv, st = T._wrapped_padded_pvalues(model, exact)
    print(plant and plant.__name__, "lazy", lazy, "min p %.2e" % min(pv), "acc %.3f" % st.acceptance_rate,
          "mean accepted %.2f" % st.mean_accepted_tokens)
    print("   calls (T, lengths, device):", dict(seen.most_common(6)))
    mp.undo()
