"""The rank-sync check of the Trainer callback under a real 2-rank DDP launch (gloo, CPU): in sync
at every log, drift named at the next check after one rank's weight moves, and a stop on request.
One launch runs the three Trainer runs (integration_tests/rank_sync_worker.py)."""
import json
from pathlib import Path

from _launch import free_port, require_success, run, torchrun_cmd, worker_env

WORKER = Path(__file__).with_name("rank_sync_worker.py")


def test_two_ddp_ranks_in_sync_then_one_nudged_drifts_and_error_stops(tmp_path, out_dir, home):
    proc = run(torchrun_cmd(["--out", str(out_dir)], nproc=2, port=free_port(), target=(str(WORKER),)),
               worker_env(home), tmp_path)
    require_success([proc])
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    for res in ranks:  # every rank logs the same verdict: it received every rank's digests
        assert all(res[v]["distributed_type"] == "MULTI_CPU" for v in res), res  # DDP on gloo, every run
        sync = res["sync"]["sync"]
        assert sorted(sync) == ["1", "2", "3", "4", "5"], sync
        for step, value in sync.items():
            assert value.startswith(f"in sync (2 ranks, ") and value.endswith(f" tensors, step {step})"), value

        drift = res["drift"]["sync"]
        assert all(drift[s].startswith("in sync") for s in ("1", "2", "3")), drift  # checked before the nudge
        for s in ("4", "5"):
            assert drift[s].startswith(f"DRIFT: rank(s) 1 differ from rank 0 at step {s}: 1/"), drift
            assert drift[s].endswith("~1.0e-03, layers.0.mlp.up_proj.weight") and len(drift[s]) <= 100, drift[s]
        assert res["drift"]["error"] is None

        stop = res["error"]
        assert stop["error"] is not None and "4" not in stop["sync"], stop  # stopped at step 4's check
        assert stop["error"].startswith("accel_patch: DRIFT: rank(s) 1 differ from rank 0 at step 4: 1/"), stop
        assert stop["error"].endswith("(ACCEL_PATCH_SYNC_CHECK=error)"), stop
    warned = [w for w in ranks[0]["drift"]["warnings"] if "DRIFT" in w]
    assert len(warned) == 1 and "rank(s) 1 differ from rank 0 at step 4" in warned[0], ranks[0]["drift"]["warnings"]
    assert not any("DRIFT" in w for w in ranks[1]["drift"]["warnings"])  # rank 0 warns, once
    assert not any("DRIFT" in w for w in ranks[0]["sync"]["warnings"])
