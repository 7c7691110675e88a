"""A save killed at any point never costs the previous checkpoint.

``LFSDP_KILL_STEPS`` lists what this launch does, in order: ``prepare`` (save v1 of both formats and remember
them), ``verify`` (both paths still load as exactly v1), and ``kill:<point>`` (start saving v2 and die at that
point). A killed launch ends with the process gone, so each kill is the last step of its launch.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from common import full, full_params, loss_fn, make_fabric
from harness import case, run_cases
from models import TinyTransformer, make_batch

ROOT = Path(os.environ["LFSDP_KILL_DIR"])
STEPS = os.environ["LFSDP_KILL_STEPS"].split(",")
WORLD = 2


def _model(fabric, seed):
    torch.manual_seed(seed)
    plain = TinyTransformer()
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    fabric.backward(loss_fn(model, make_batch(seed, fabric.global_rank)))
    opt.step()
    return model, opt


def _opt_state(opt) -> dict[str, torch.Tensor]:
    """Every tensor of the optimizer's state (``step``, ``exp_avg``, ``exp_avg_sq`` of every parameter), gathered."""
    return {f"{i}.{k}": full(v).clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()}


def _die(point: str, where: str) -> None:
    # The marker proves to the pytest side that this launch died at the intended point, not of something else.
    (ROOT / f"killed-{point}").write_text(f"rank {os.environ.get('RANK')}: {where}")
    print(f"[rank {os.environ.get('RANK')}] killed {where}", flush=True)
    os._exit(17)


def _arm(point: str, rank: int) -> None:
    """Make this rank die at ``point`` during the next save."""
    if rank != (1 if point == "sharded_write" else 0):
        return
    die = lambda where: _die(point, where)  # noqa: E731
    if point == "sharded_write":
        import torch.distributed.checkpoint.filesystem as fs

        def write_half_then_die(self, plan, planner):
            (Path(self.path) / "__1_0.distcp").write_bytes(b"partial")
            die("in the middle of writing its DCP shard")

        fs.FileSystemWriter.write_data = write_half_then_die
    elif point == "full_write":
        import lightning_fsdp.checkpoint.io.full_writer as fw

        original = fw.open_zipfile_writer

        class DyingWriter:
            def __init__(self, path):
                self.inner = original(path)

            def __enter__(self):
                writer = self.inner.__enter__()
                records = {"n": 0}
                write = writer.write_record

                class Proxy:
                    def write_record(self, *args):
                        records["n"] += 1
                        if records["n"] > 5:
                            die("after writing a few records of the full file")
                        return write(*args)

                return Proxy()

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

        fw.open_zipfile_writer = DyingWriter
    elif point == "between_renames":
        import lightning_fsdp.checkpoint.io.atomic as atomic

        original = atomic.os.replace
        calls = {"n": 0}

        def replace_then_die(src, dst):
            original(src, dst)
            calls["n"] += 1
            if calls["n"] == 1 and str(dst).endswith(atomic.BACKUP_SUFFIX):
                die("after moving the old checkpoint aside, before moving the new one in")

        atomic.os.replace = replace_then_die
    else:
        raise ValueError(point)


@case
def run_steps():
    done = []
    for step in STEPS:
        kind, _, point = step.partition(":")
        if kind == "prepare":
            for fmt, name in (("sharded", "sharded"), ("full", "full.pt")):
                fabric = make_fabric(WORLD, state_dict_type=fmt)
                model, opt = _model(fabric, seed=1)
                fabric.save(ROOT / name, {"model": model, "optimizer": opt, "version": 1})
            expected = {"model": full_params(model), "optimizer": _opt_state(opt)}  # collectives: every rank
            assert len(expected["optimizer"]) == 3 * len(expected["model"]), sorted(expected["optimizer"])
            if fabric.global_rank == 0:
                torch.save(expected, ROOT / "expected.pt")
        elif kind == "verify":
            expected = torch.load(ROOT / "expected.pt", weights_only=True)
            for fmt, name in (("sharded", "sharded"), ("full", "full.pt")):
                fabric = make_fabric(WORLD, state_dict_type=fmt)
                model, opt = _model(fabric, seed=5)
                state = {"model": model, "optimizer": opt, "version": 0}
                fabric.load(ROOT / name, state)
                got = {"model": full_params(model), "optimizer": _opt_state(opt)}
                assert state["version"] == 1, f"{name}: version {state['version']}"
                for part in ("model", "optimizer"):
                    e, g = expected[part], got[part]
                    assert g.keys() == e.keys(), f"{name} {part}: keys {sorted(set(g) ^ set(e))}"
                    differ = [k for k in e if not torch.equal(g[k], e[k])]
                    assert not differ, f"{name} {part}: not exactly v1 in {differ[:5]}"
        elif kind == "kill":
            fmt, name = ("full", "full.pt") if point == "full_write" else ("sharded", "sharded")
            fabric = make_fabric(WORLD, state_dict_type=fmt)
            model, opt = _model(fabric, seed=2)
            _arm(point, fabric.global_rank)
            fabric.save(ROOT / name, {"model": model, "optimizer": opt, "version": 2})
            raise AssertionError(f"the save survived the kill at {point}")
        elif kind == "save_again":
            for fmt, name in (("sharded", "sharded"), ("full", "full.pt")):
                fabric = make_fabric(WORLD, state_dict_type=fmt)
                model, opt = _model(fabric, seed=3)
                fabric.save(ROOT / name, {"model": model, "optimizer": opt, "version": 3})
            leftovers = sorted(p.name for p in ROOT.iterdir() if p.name not in ("sharded", "full.pt", "expected.pt"))
            assert not leftovers, f"staging or backup copies survived the next save: {leftovers}"
        done.append(step)
    return done


if __name__ == "__main__":
    run_cases()
