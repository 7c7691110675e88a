"""Issue 43 at world 4 and 8 against the ledger server (``tests/ledger.py``): each rank moves only its own bytes.

Three launches share one bucket and one folder (``LFSDP_SCALE_DIR``), in this order (``LFSDP_SCALE_PHASE``):

- ``first`` (world 4): save C4 (and steps 1 and 2 into two directories for ``latest``); load C4 -> 4; a full
  (one-file) save and load;
- ``wide`` (world 8): ``latest`` over a damaged newest; save C8; load C8 -> 8 and C4 -> 8; a byte flipped in C4
  where only rank 5 reads it;
- ``narrow`` (world 4): load C8 -> 4; ``latest`` over a good newest.

A save writes ``expected_<name>.pt`` (the full parameters and optimizer state, gathered right after it), and every
load compares with it exactly. The byte figures come from the ledger, by access key: each rank signs with its own
(``r<rank>``, set below before any client exists), and reads its records of a case over the ledger's control path.

Local disk: each rank gets its own ``TMPDIR`` (``<LFSDP_SCALE_TMP>/r<rank>``, fresh per launch, set below, and
``tempfile``'s cached folder cleared so that it is used: the fork server may have asked for it before). A sampler
thread walks that folder every 2 ms while the save or load runs and records the peak of the total size of its files
above what they were when the block began. A sampler can miss a file that lives less than 2 ms; the staging copy
and the downloaded objects it is there to catch live for the whole transfer (tens of milliseconds at least), and the
test states the target (<= 0.1x the shard), not zero.

Every check of a case is gathered across ranks before anything is raised (:func:`_agree`), so a failed figure on one
rank fails the case on every rank, with every rank's numbers, instead of leaving the others waiting in the next
case's collectives.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import threading
import time
import urllib.request
import zipfile
from pathlib import Path

RANK = int(os.environ.get("RANK", "0"))
# Before anything creates an S3 client or asks for the temp folder (see the module's docstring).
os.environ["AWS_ACCESS_KEY_ID"] = f"r{RANK}"
TMP = Path(os.environ["LFSDP_SCALE_TMP"]) / f"r{RANK}"
TMP.mkdir(parents=True, exist_ok=True)
os.environ["TMPDIR"] = str(TMP)
tempfile.tempdir = None

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from common import full, full_params, make_fabric  # noqa: E402
from harness import case, run_cases  # noqa: E402

assert tempfile.gettempdir() == str(TMP), tempfile.gettempdir()

PHASE = os.environ["LFSDP_SCALE_PHASE"]
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
ROOT = Path(os.environ["LFSDP_SCALE_DIR"])
BUCKET = os.environ["LFSDP_TEST_BUCKET"]
ENDPOINT = os.environ["AWS_ENDPOINT_URL"]
SMALL = (".metadata", "checksums.json", "meta.pt", "COMMIT")
DIM = 512  # a C4 item of a weight holds 128 rows (256 KiB): halves fall on whole 64 KiB digest blocks (a 4 -> 8 read)


def url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _setup(fabric, seed: int, steps: int = 0):
    torch.manual_seed(seed)
    plain = Tiny()
    model, opt = fabric.setup(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    for step in range(steps):
        batch = torch.randn(4, DIM, generator=torch.Generator().manual_seed(100 * step + fabric.global_rank))
        fabric.backward(model(batch).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return model, opt


def _named_opt_state(model, opt) -> dict:
    names = [n.removeprefix("_forward_module.") for n, _ in model.named_parameters()]
    return {f"{names[i]}/{k}": full(v).clone() for i, per_param in opt.state_dict()["state"].items()
            for k, v in per_param.items()}


def _gathered(model, opt) -> dict:
    return {"params": full_params(model), "optim": _named_opt_state(model, opt)}


def _same(got: dict, expected: dict) -> list[str]:
    problems = []
    for part in ("params", "optim"):
        if got[part].keys() != expected[part].keys():
            problems.append(f"{part} keys differ: {sorted(set(got[part]) ^ set(expected[part]))[:6]}")
            continue
        problems += [f"{part} {k} differs" for k in expected[part] if not torch.equal(got[part][k], expected[part][k])]
    return problems


def _share(model, opt) -> int:
    """The tensor bytes this rank holds of the state a load fills: its local shards of the parameters and of the
    optimizer's state (a replicated tensor, AdamW's step, counts whole)."""
    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    return (sum(local(p) for p in model.parameters())
            + sum(local(v) for s in opt.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v)))


def _records_since(mark: int) -> list[dict]:
    with urllib.request.urlopen(f"{ENDPOINT}/_ledger/records?since={mark}", timeout=60) as answer:
        return json.loads(answer.read())["records"]


class _Watch:
    """The ledger's records of this rank, and the peak size of its TMPDIR, while a block runs (every rank enters and
    leaves it together: a barrier on each side)."""

    def __init__(self, fabric):
        self.fabric = fabric

    def __enter__(self):
        self.fabric.barrier()
        with urllib.request.urlopen(f"{ENDPOINT}/_ledger/records?since=1000000000", timeout=60) as answer:
            self.mark = json.loads(answer.read())["next"]
        self.start = self._size()
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def _size() -> int:
        total = 0
        for folder, _, files in os.walk(TMP):
            for name in files:
                try:
                    total += os.stat(os.path.join(folder, name)).st_size
                except OSError:  # removed meanwhile
                    pass
        return total

    def _sample(self):
        """The peak of what the block added to TMPDIR (what earlier cases left there is not this block's)."""
        while not self._stop.is_set():
            self.peak = max(self.peak, self._size() - self.start)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.fabric.barrier()
        self.records = [r for r in _records_since(self.mark) if r["access_key"] == f"r{RANK}"]
        return False

    def got(self, test) -> int:
        return sum(r["bytes_out"] for r in self.records if r["method"] == "GET" and test(r["key"]))

    def put(self, test) -> int:
        return sum(r["bytes_in"] for r in self.records if r["method"] in ("PUT", "POST") and test(r["key"]))

    def requested(self, test, methods=("GET",)) -> list[str]:
        return [f"{r['method']} {r['key']}" for r in self.records if r["method"] in methods and test(r["key"])]


def _agree(problems: list[str], figures: dict) -> dict:
    """Raise on every rank if any rank found a problem, with every rank's problems and figures."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, {"problems": problems, "figures": figures})
    if any(r["problems"] for r in every):
        lines = [f"rank {i}: {'; '.join(r['problems']) or 'ok'} | {r['figures']}" for i, r in enumerate(every)]
        raise AssertionError("\n".join(lines))
    return figures


def _setup_fs():
    """A filesystem that signs as ``setup``, for what the test itself reads or damages (not a rank's figures)."""
    import s3fs

    return s3fs.S3FileSystem(key="setup", secret="testing", endpoint_url=ENDPOINT, skip_instance_cache=True,
                             use_listings_cache=False)


def _objects(prefix: str) -> dict[str, int]:
    """``{key below the bucket: size}`` of every object under ``prefix``."""
    found = _setup_fs().find(prefix.removeprefix("s3://"), detail=True)
    return {k.split("/", 1)[1]: v["size"] for k, v in found.items()}


def _distcp(key: str) -> bool:
    return key.endswith(".distcp")


def _small(key: str) -> bool:
    return key.rsplit("/", 1)[-1] in SMALL


# ----------------------------------------------------------------------------------------------- the checks


def _save(name: str, steps: int = 1, then=lambda: None) -> dict:
    """A sharded save streams: rank r PUTs only its own ``__<r>_*.distcp`` objects, their bytes once; only rank 0
    PUTs the small objects; TMPDIR holds at most 0.1x the rank's shard meanwhile."""
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric, seed=0, steps=steps)
    with _Watch(fabric) as watch:
        fabric.save(url(name), {"model": model, "optimizer": opt, "step": steps})
    expected = _gathered(model, opt)
    if RANK == 0:
        torch.save(expected, ROOT / f"expected_{name}.pt")
    objects = _objects(url(name))
    mine = {k: s for k, s in objects.items() if k.rsplit("/", 1)[-1].startswith(f"__{RANK}_") and _distcp(k)}
    shard = sum(mine.values())
    put_own = watch.put(lambda k: k in mine)
    put_other = watch.requested(lambda k: _distcp(k) and k not in mine, ("PUT", "POST"))
    put_small = watch.requested(_small, ("PUT", "POST"))
    figures = {"shard": shard, "put_own_distcp": put_own, "tmpdir_peak": watch.peak,
               "tmpdir_ratio": round(watch.peak / max(1, shard), 3)}
    problems = []
    if not mine:
        problems.append(f"no object of rank {RANK} among {sorted(objects)}")
    if not shard <= put_own <= 1.02 * shard:  # each byte once; 2% for a part sent again after a transient error
        problems.append(f"PUT {put_own} bytes of its own .distcp objects, which hold {shard} (target 1x to 1.02x)")
    if put_other:
        problems.append(f"PUT other ranks' objects: {put_other[:4]}")
    if RANK != 0 and put_small:
        problems.append(f"rank {RANK} PUT small objects: {put_small}")
    if RANK == 0 and not any(k.endswith("COMMIT") for k in put_small):
        problems.append(f"rank 0 did not PUT COMMIT ({put_small})")
    if watch.peak > 0.1 * shard:
        problems.append(f"TMPDIR held {watch.peak} bytes during the save, {figures['tmpdir_ratio']}x the shard"
                        " (target <= 0.1x)")
    then()  # before any figure fails the case: what later launches need from this one
    return _agree(problems, figures)


def _load(name: str, target: str | None = None) -> dict:
    """A sharded load reads only what the rank needs: its GET bytes of ``.distcp`` objects <= 1.1x its share of
    tensor bytes; ranks != 0 GET none of the small objects; TMPDIR <= 0.1x the share; the state exactly."""
    fabric = make_fabric(WORLD)
    model, opt = _setup(fabric, seed=123, steps=1)  # a different state, optimizer state included, to be replaced
    state = {"model": model, "optimizer": opt, "step": 0}
    with _Watch(fabric) as watch:
        fabric.load(target or url(name), state)
    problems = _same(_gathered(model, opt), torch.load(ROOT / f"expected_{name}.pt", weights_only=True))
    share = _share(model, opt)
    distcp = watch.got(_distcp)
    small = watch.requested(_small)
    figures = {"share": share, "get_distcp": distcp, "ratio": round(distcp / share, 3),
               "get_small": watch.got(_small), "tmpdir_peak": watch.peak,
               "tmpdir_ratio": round(watch.peak / share, 3)}
    if state["step"] != 1:
        problems.append(f"step {state['step']} != 1")
    if distcp > 1.1 * share:
        problems.append(f"GET {distcp} bytes of .distcp objects, {figures['ratio']}x its share (target <= 1.1x)")
    if RANK != 0 and small:
        problems.append(f"rank {RANK} read small objects: {small}")
    if watch.peak > 0.1 * share:
        problems.append(f"TMPDIR held {watch.peak} bytes during the load, {figures['tmpdir_ratio']}x its share"
                        " (target <= 0.1x)")
    return _agree(problems, figures)


def _latest(name: str, damaged: bool) -> dict:
    """``latest`` in a directory of steps 1 and 2 (C1, C2), in a process that neither saved nor verified them.
    ``damaged``: a byte in the middle of rank 1's object of C2 is flipped first; ``latest`` must load C1 exactly, for
    at most C2's partial read (<= 1.1x C2, the read that finds the damage) + 1.1x C1, over all ranks. Else it loads C2
    exactly for at most 1.1x C2 in all (today: rank 0 verifies by downloading it, then every rank downloads it)."""
    fabric = make_fabric(WORLD)
    directory = url(name)
    objects = _objects(directory)
    size = {s: sum(n for k, n in objects.items() if f"step-0000000{s}/" in k and _distcp(k)) for s in (1, 2)}
    if damaged and RANK == 0:
        key = next(k for k in objects if "step-00000002/" in k and k.endswith("__1_0.distcp"))
        _flip(key, objects[key] // 2)
    fabric.barrier()
    loads = 1 if damaged else 2
    model, opt = _setup(fabric, seed=123, steps=1)
    state = {"model": model, "optimizer": opt, "step": 0}
    with _Watch(fabric) as watch:
        fabric.load(f"{directory}/latest", state)
    problems = _same(_gathered(model, opt), torch.load(ROOT / f"expected_step{loads}.pt", weights_only=True))
    if state["step"] != loads:
        problems.append(f"latest loaded step {state['step']}, not {loads}")
    every = [None] * WORLD
    dist.all_gather_object(every, {s: watch.got(lambda k, s=s: f"step-0000000{s}/" in k and _distcp(k)) for s in (1, 2)})
    moved = {s: sum(r[s] for r in every) for s in (1, 2)}  # the whole job's bytes: the same on every rank
    figures = {f"C{s}": f"{moved[s]} of {size[s]} ({round(moved[s] / size[s], 3)}x)" for s in (1, 2)}
    if damaged and (moved[2] > 1.1 * size[2] or moved[1] > 1.1 * size[1]):
        problems.append(f"over a damaged newest, latest moved {moved[2]} bytes of C2 ({size[2]}) and {moved[1]} of C1"
                        f" ({size[1]}): target C2's partial read (<= 1.1x C2) + 1.1x C1")
    if not damaged and moved[1] + moved[2] > 1.1 * size[2]:
        problems.append(f"over a good newest, latest moved {moved[1] + moved[2]} bytes of .distcp objects,"
                        f" {round((moved[1] + moved[2]) / size[2], 2)}x C2 (target <= 1.1x)")
    return _agree(problems, figures)


def _steps_for_latest() -> None:
    """``run`` and ``fine`` each get steps 1 and 2 (the same states). The loads through ``latest`` run in the
    later launches: a process trusts the checkpoints it committed itself (``latest.trust``) and remembers what it
    verified, so a ``latest`` in this process would not verify at all."""
    from lightning_fsdp.step_checkpoints import StepCheckpoints

    fabric = make_fabric(WORLD)
    directories = [StepCheckpoints(fabric, url(name), keep_last=3) for name in ("run", "fine")]
    for step in (1, 2):
        model, opt = _setup(fabric, seed=0, steps=step)
        for checkpoints in directories:
            checkpoints.save({"model": model, "optimizer": opt, "step": step})
        expected = _gathered(model, opt)
        if RANK == 0:
            torch.save(expected, ROOT / f"expected_step{step}.pt")
    names = sorted(k.split("/")[1] for k in _objects(url("run")) if k.endswith("/COMMIT"))
    assert names == ["step-00000001", "step-00000002"], names


def _flip(key: str, offset: int) -> None:
    fs = _setup_fs()
    data = bytearray(fs.cat_file(f"{BUCKET}/{key}"))
    data[offset] ^= 0x01
    fs.pipe_file(f"{BUCKET}/{key}", bytes(data))


if PHASE == "first":

    @case
    def sharded_save_at_world_4_streams_each_rank_s_own_file():
        """Also saves what the later launches' ``latest`` cases read (:func:`_steps_for_latest`)."""
        return _save("c4", then=_steps_for_latest)

    @case
    def sharded_load_4_to_4_reads_only_each_rank_s_share():
        return _load("c4")

    @case
    def full_save_and_load_at_world_4_ranks_other_than_0_download_nothing():
        fabric = make_fabric(WORLD, state_dict_type="full")
        model, opt = _setup(fabric, seed=0, steps=1)
        fabric.save(url("full4"), {"model": model, "optimizer": opt, "step": 1})
        expected = _gathered(model, opt)
        objects = {k: s for k, s in _objects(url("full4")).items() if not _small(k)}
        file_key, file_size = max(objects.items(), key=lambda kv: kv[1])
        model2, opt2 = _setup(fabric, seed=123, steps=1)
        state = {"model": model2, "optimizer": opt2, "step": 0}
        with _Watch(fabric) as watch:
            fabric.load(url("full4"), state)
        problems = _same(_gathered(model2, opt2), expected)
        got = watch.got(lambda k: k == file_key)
        figures = {"file": file_size, "get_file": got, "ratio": round(got / file_size, 3), "tmpdir_peak": watch.peak}
        if RANK != 0 and got:
            problems.append(f"rank {RANK} GET {got} bytes of the file (target 0)")
        if RANK == 0 and got > 1.02 * file_size:
            problems.append(f"rank 0 GET {got} bytes of the file, {figures['ratio']}x (target <= 1.02x)")
        return _agree(problems, figures)

elif PHASE == "wide":

    @case
    def latest_over_a_damaged_newest_loads_the_one_before_for_its_partial_read_plus_1_1x():
        return _latest("run", damaged=True)

    @case
    def sharded_save_at_world_8_streams_each_rank_s_own_file():
        return _save("c8")

    @case
    def sharded_load_8_to_8_reads_only_each_rank_s_share():
        return _load("c8")

    @case
    def sharded_load_4_to_8_reads_only_the_overlapping_ranges():
        return _load("c4")

    @case
    def a_byte_flipped_where_only_rank_5_reads_fails_the_load_on_every_rank_naming_object_and_tensor():
        """C4's rank 2 holds rows 256..383 of each weight; at world 8 rank 4 reads rows 256..319 and rank 5 rows
        320..383. The flipped byte is at row 352 of ``layers.1.weight``: in the 64 KiB digest block 3 of the item's
        payload, which only rank 5 reads."""
        import pickle

        from lightning_fsdp.checkpoint.integrity.digests import ChecksumError

        fabric = make_fabric(WORLD)
        tensor, key = "model.layers.1.weight", None
        if RANK == 0:
            fs = _setup_fs()
            objects = _objects(url("c4"))
            metadata_key = next(k for k in objects if k.endswith("/.metadata"))
            metadata = pickle.loads(fs.cat_file(f"{BUCKET}/{metadata_key}"))
            index, info = next((i, s) for i, s in metadata.storage_data.items()
                               if i.fqn == tensor and tuple(i.offset) == (256, 0))
            assert info.relative_path == "__2_0.distcp", info
            key = metadata_key.rsplit("/", 1)[0] + "/" + info.relative_path
            item = fs.cat_file(f"{BUCKET}/{key}", start=info.offset, end=info.offset + info.length)
            with zipfile.ZipFile(io.BytesIO(item)) as archive:
                entry = next(e for e in archive.infolist() if e.filename.endswith("/data/0"))
            name_len, extra_len = int.from_bytes(item[entry.header_offset + 26:entry.header_offset + 28], "little"), \
                int.from_bytes(item[entry.header_offset + 28:entry.header_offset + 30], "little")
            payload = entry.header_offset + 30 + name_len + extra_len
            assert entry.file_size == 128 * DIM * 4, entry.file_size
            _flip(key, info.offset + payload + (352 - 256) * DIM * 4)
        object_url = f"s3://{BUCKET}/{fabric.broadcast(key)}"
        model, opt = _setup(fabric, seed=123, steps=1)
        try:
            fabric.load(url("c4"), {"model": model, "optimizer": opt})
        except ChecksumError as err:
            message = str(err)
            problems = [f"the error does not name {what!r}: {message[:400]}"
                        for what in (object_url, "layers.1.weight") if what not in message]
            return _agree(problems, {"error": message[:300]})
        except Exception as err:  # noqa: BLE001 - any other error is reported as what it is
            return _agree([f"{type(err).__name__} instead of ChecksumError: {str(err)[:300]}"], {})
        return _agree(["the damaged checkpoint loaded"], {})

else:

    @case
    def sharded_load_8_to_4_reads_only_each_rank_s_share():
        return _load("c8")

    @case
    def latest_over_a_good_newest_loads_it_for_1_1x():
        return _latest("fine", damaged=False)


if __name__ == "__main__":
    run_cases()
