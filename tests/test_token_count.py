"""The tokens a training forward trains on, from what the batch carries: labels not ignored, a 2-D
mask of 0/1 or of packed-sequence numbers, a 4-D boolean or additive mask; never a non-finite
figure."""
from __future__ import annotations

import torch

from accel_patch.integrations.callback import step_tokens

IDS = torch.arange(12).view(2, 6)
PACKED = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 2, 3, 3, 0, 0]])  # 2 rows, 9 tokens, 3 padding


def additive_4d(numbers, dtype=torch.float32):
    # as LLaMA-Factory's neat_packing builds it: 0 where attended, finfo.min elsewhere
    same = numbers[:, None, :, None] == numbers[:, None, None, :]
    keep = same & (numbers != 0)[:, None, None, :] & torch.ones(6, 6, dtype=torch.bool).tril()
    return torch.where(keep, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min), keep


def test_a_packed_2d_mask_counts_its_tokens_not_the_sum_of_their_numbers():
    assert step_tokens({"input_ids": IDS, "attention_mask": PACKED}).item() == 9
    assert step_tokens({"input_ids": IDS, "attention_mask": (PACKED != 0).long()}).item() == 9


def test_a_4d_additive_or_boolean_mask_counts_the_positions_that_see_themselves():
    for dtype in (torch.float32, torch.bfloat16):
        additive, boolean = additive_4d(PACKED, dtype)
        n = step_tokens({"input_ids": IDS, "attention_mask": additive})
        assert torch.isfinite(n) and n.item() == 9
        assert step_tokens({"input_ids": IDS, "attention_mask": boolean}).item() == 9
    inf = torch.zeros(2, 1, 6, 6).masked_fill(~additive_4d(PACKED)[1], float("-inf"))
    assert step_tokens({"input_ids": IDS, "attention_mask": inf}).item() == 9


def test_labels_count_before_the_mask_and_padding_without_a_mask_is_not_counted():
    labels = IDS.masked_fill(PACKED == 0, -100)
    assert step_tokens({"input_ids": IDS, "labels": labels}).item() == 9  # sample packing: no mask
    assert step_tokens({"input_ids": IDS, "attention_mask": PACKED, "labels": labels}).item() == 9
    assert step_tokens({"input_ids": IDS}).item() == 12  # nothing says which are padding
    assert step_tokens({}, (IDS,)).item() == 12
    assert step_tokens({"input_ids": IDS, "labels": torch.tensor([0, 1])}).item() == 12  # sequence labels
    assert step_tokens({"inputs_embeds": torch.zeros(2, 6, 4)}).item() == 12
    assert step_tokens({}) is None


def test_a_non_finite_count_never_reaches_the_logs():
    import time
    from types import SimpleNamespace

    from accel_patch import AccelPatchCallback

    callback = AccelPatchCallback()
    callback._tokens = torch.tensor(float("-inf"), dtype=torch.float64)
    callback._mark = (time.perf_counter() - 1.0, 0, 0.0)
    added = callback._metrics_values(SimpleNamespace(include_num_input_tokens_seen="no"),
                                     SimpleNamespace(global_step=2, num_input_tokens_seen=0), None, first=False)
    assert "step_time_s" in added and "tokens_per_second" not in added
