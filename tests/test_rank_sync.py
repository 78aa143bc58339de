"""The rank-sync checksum and verdict (accel_patch/core/rank_sync.py), in one process: the checksum
sees one ulp in a million elements and nothing else, the verdict names the ranks that differ, and
bad settings are clear errors. The real 2-rank DDP Trainer run is integration_tests/test_rank_sync_ddp.py."""
from __future__ import annotations

import pytest
import torch

import accel_patch
from accel_patch.core import rank_sync


def one_ulp_up(t: torch.Tensor, i: int) -> torch.Tensor:
    """`t` with element i moved by one unit in the last place (its bit pattern + 1)."""
    out = t.clone()
    out.view(-1).view({2: torch.int16, 4: torch.int32}[t.element_size()])[i] += 1
    return out


@pytest.mark.parametrize("dtype, where", [(torch.float32, (0, 123_457, (1 << 20) - 1)), (torch.bfloat16, (654_321,))])
def test_one_ulp_in_a_million_elements_is_caught_and_equal_tensors_never_differ(dtype, where):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(1 << 20, generator=g).to(dtype)
    others = [torch.randn(300, generator=g).to(dtype), torch.randn(7, 5, generator=g).to(dtype)]
    ref_hash, ref_sketch = rank_sync.digest_tensors([base, *others])
    again, _ = rank_sync.digest_tensors([base.clone(), *(o.clone() for o in others)])  # a bitwise-equal replica
    assert torch.equal(again, ref_hash)
    for i in where:
        nudged = one_ulp_up(base, i)
        assert (nudged != base).sum() == 1
        h, s = rank_sync.digest_tensors([nudged, *others])
        assert h[0] != ref_hash[0] and torch.equal(h[1:], ref_hash[1:]), i  # that tensor's slot, only
        change = abs(float(nudged[i].double() - base[i].double()))
        assert abs(float(s[0] - ref_sketch[0])) == pytest.approx(change, rel=1e-6)  # the size: exactly its change
    small = one_ulp_up(others[1], 17)  # small tensors are hashed together: still their own slot
    h, _ = rank_sync.digest_tensors([base, others[0], small])
    assert h[2] != ref_hash[2] and torch.equal(h[:2], ref_hash[:2])


def test_moved_elements_and_a_negative_zero_are_caught_a_float_sum_would_not_be():
    t = torch.randn(1000)
    swapped = t.clone()
    swapped[[3, 700]] = t[[700, 3]]  # the same values elsewhere: a sum of values cannot see it
    signed = t.clone()
    signed[5] = 0.0
    negative = signed.clone()
    negative[5] = -0.0  # bitwise different, numerically equal
    digest = lambda x: int(rank_sync.digest_tensors([x])[0][0])  # noqa: E731
    assert digest(swapped) != digest(t) and digest(negative) != digest(signed)


def test_an_accelerator_s_work_buffers_are_released_when_a_check_ends():
    # a GPU's five chunk-long buffers (40 bytes an element) would otherwise stay allocated for the
    # rest of training; the CPU's (a few MiB, reused) stay
    assert rank_sync._chunk_len(torch.device("cuda", 0)) == 1 << 22  # 160 MiB while a check runs
    gpu = ("cuda:0", rank_sync._chunk_len(torch.device("cuda", 0)))
    rank_sync._constants._cache[gpu] = "stand-in for a GPU's buffers"
    rank_sync.digest_tensors([torch.randn(100)])
    assert gpu not in rank_sync._constants._cache
    assert ("cpu", rank_sync._chunk_len(torch.device("cpu"))) in rank_sync._constants._cache


class FakeWorld:
    """all_gather over `world` ranks in one process: every rank sends this payload, with `edits`
    (rank -> a function changing its copy) applied."""

    def __init__(self, monkeypatch, world, edits):
        self.edits = edits
        monkeypatch.setattr(rank_sync, "_world", lambda group: world)
        monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: "gloo")
        monkeypatch.setattr(torch.distributed, "all_gather", self.all_gather)

    def all_gather(self, out, payload, group=None):
        for r, slot in enumerate(out):
            slot.copy_(payload)
            if r in self.edits:
                self.edits[r](slot)


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)  # frozen: not compared
    return model


def test_the_verdict_names_the_ranks_that_differ_the_step_and_the_size(monkeypatch):
    def nudge_slot(slot_index, by):
        def edit(payload):
            payload[rank_sync.HEADER + slot_index] += 1
            sketch = payload[rank_sync.HEADER + rank_sync.SLOTS:].view(torch.float64)
            sketch[slot_index] += by
        return edit

    FakeWorld(monkeypatch, 4, {})
    ok = accel_patch.check_rank_sync(tiny(), step=7)
    assert ok.ok and str(ok) == "in sync (4 ranks, 3 tensors, step 7)" and ok.every >= 1

    FakeWorld(monkeypatch, 4, {1: nudge_slot(2, 2e-3), 3: nudge_slot(0, 5e-4)})
    bad = accel_patch.check_rank_sync(tiny(), step=40)
    assert not bad.ok and bad.ranks == (1, 3) and bad.differing == 1 and bad.size == pytest.approx(2e-3)
    assert str(bad) == "DRIFT: rank(s) 1, 3 differ from rank 0 at step 40: 1/3 tensors, ~2.0e-03, 0.weight"

    FakeWorld(monkeypatch, 64, {r: nudge_slot(1, 1.0) for r in range(1, 64) if r != 9})
    many = accel_patch.check_rank_sync(tiny(), step=1)
    assert str(many).startswith("DRIFT: rank(s) 1-8, 10-63 differ from rank 0 at step 1: 1/3 tensors")
    assert len(str(many)) <= 100

    def other_model(payload):
        payload[0] += 1
    FakeWorld(monkeypatch, 2, {1: other_model})
    assert "different parameter sets" in str(accel_patch.check_rank_sync(tiny()))


def test_sharded_parameters_are_the_engines_and_one_process_checks_nothing(monkeypatch):
    model = tiny()
    model[0].weight.ds_id = 3  # a DeepSpeed ZeRO-3 partition
    names, tensors, sharded = rank_sync.replicated_trainable(model)
    assert names == ["0.bias", "1.weight"] and sharded == 1
    FakeWorld(monkeypatch, 2, {})
    assert str(accel_patch.check_rank_sync(model, step=2)) == "in sync (2 ranks, 2 tensors, step 2; 1 sharded: the engine's)"
    monkeypatch.undo()
    assert str(accel_patch.check_rank_sync(tiny())) == "not checked: one process"  # no process group
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert accel_patch.check_rank_sync(tiny()).message.startswith("not checked: 2 processes but no process group")


def test_settings_are_read_and_bad_values_named():
    assert rank_sync.sync_every({}) is None and rank_sync.sync_every({"ACCEL_PATCH_SYNC_EVERY": " auto "}) is None
    assert rank_sync.sync_every({"ACCEL_PATCH_SYNC_EVERY": "0"}) == 0
    assert rank_sync.sync_every({"ACCEL_PATCH_SYNC_EVERY": "25"}) == 25
    with pytest.raises(ValueError, match=r"ACCEL_PATCH_SYNC_EVERY='two' is not valid: use a whole number"):
        rank_sync.sync_every({"ACCEL_PATCH_SYNC_EVERY": "two"})
    assert rank_sync.sync_mode({}) == "warn" and rank_sync.sync_mode({"ACCEL_PATCH_SYNC_CHECK": "Error"}) == "error"
    with pytest.raises(ValueError, match=r"ACCEL_PATCH_SYNC_CHECK='loud' is not valid: use 'warn'"):
        rank_sync.sync_mode({"ACCEL_PATCH_SYNC_CHECK": "loud"})
    # the automatic interval keeps the check under 0.5% of the step time
    assert rank_sync.auto_every(0.001, 0.1) == 2 and rank_sync.auto_every(0.0005, 0.1) == 1
    assert rank_sync.auto_every(0.06, 0.4) == 30 and rank_sync.auto_every(100.0, 0.01) == rank_sync.MAX_AUTO_EVERY


def test_the_checksum_is_the_documented_wrapping_integer_mix():
    """A pure-Python reference of the mix (int64 wrapping arithmetic): torch's int64 multiply and
    sum must wrap as documented, on every platform the check runs on."""
    mask = (1 << 64) - 1

    def reference(values, start):
        total = 0
        for i, v in enumerate(values):
            x = (v & mask) ^ ((i * rank_sync._POSITION) & mask) ^ ((start * rank_sync._POSITION) & mask)
            x = (x * rank_sync._SCRAMBLE) & mask
            x ^= x >> 29
            total = (total + x) & mask
        return rank_sync._i64(total)

    t = torch.randn(500, generator=torch.Generator().manual_seed(1))
    ints = t.view(torch.int32)
    assert int(rank_sync._mix(ints, 12345).sum()) == reference(ints.tolist(), 12345)
    hashes, _ = rank_sync.digest_tensors([t])
    assert int(hashes[0]) == reference(ints.tolist(), 0)
