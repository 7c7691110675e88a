"""A verified checkpoint is the checkpoint that was saved (issue 21, part A; see ``workers/tamper.py``): one
two-rank launch, plus single-process checks of the walks and the allow-list unpickler."""

import contextlib
import pathlib
import pickle
import signal

import pytest
import torch

from launch import case_tests
from lightning_fsdp.checkpoint.integrity.safe_pickle import UnsafeCheckpointError, load_dcp_metadata
from lightning_fsdp.checkpoint.integrity.zip_index import tensor_record_paths

CASES = [
    "swapped_files_are_refused_on_every_rank",
    "changed_chunk_offset_in_metadata_is_refused",
    "shared_and_deep_data_load_at_once_or_are_refused",
    "metadata_cannot_change_allowed_classes",
    "garbage_metadata_is_one_checkpoint_error_on_every_rank",
]

results, test_case = case_tests("tamper.py", 2, CASES)


@contextlib.contextmanager
def _no_hang(seconds=60):
    """Turns the old code's endless walk (2**60 nodes) into a failure; the new one takes milliseconds. Not a timing
    assertion: the bound only stops a hang."""

    def hang(*_):
        raise TimeoutError("the walk did not finish: it follows every path of the shared list")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _dag(levels):
    shared = [0]
    for _ in range(levels):
        shared = [shared, shared]
    return shared


def test_walks_visit_shared_containers_once_and_keep_them_shared():
    from lightning_fsdp.checkpoint.integrity import tree

    dag = _dag(60)
    copy = tree.map_leaves({"a": dag, "b": (dag, torch.zeros(1))}, lambda leaf, path: leaf, what="x")
    assert copy["a"] is copy["b"][0] and copy["a"][0] is copy["a"][1]
    assert [path for path, _ in tree.leaves(dag, what="x")] == [(0,) * 61]
    cyclic = [1]
    cyclic.append(cyclic)
    copy = tree.map_leaves(cyclic, lambda leaf, path: leaf, what="x")
    assert copy[1] is copy and copy[0] == 1


def test_walks_stop_at_the_depth_bound_naming_the_data():
    from lightning_fsdp.checkpoint.integrity import tree

    deep = []
    for _ in range(tree.MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(tree.TreeLimitError, match=r"'ckpt.pt' nests containers more than 100 levels deep"):
        tree.map_leaves({"history": deep}, lambda leaf, path: leaf, what="'ckpt.pt'")


def test_index_walk_of_a_dag_file_finishes(tmp_path):
    torch.save({"model": {"w": torch.ones(2)}, "history": _dag(60)}, tmp_path / "dag.pt")
    import zipfile

    with zipfile.ZipFile(tmp_path / "dag.pt") as archive:
        index = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    with _no_hang():
        assert tensor_record_paths(index) == {"0": ("model", "w")}


def test_full_writer_writes_shared_state_once(tmp_path):
    from lightning_fsdp.checkpoint.io.full_writer import write_streaming

    with _no_hang():
        write_streaming(tmp_path / "dag.pt", {"model": {"w": torch.ones(3)}, "history": _dag(60)}, lambda t: t)
    loaded = torch.load(tmp_path / "dag.pt", weights_only=True)
    assert loaded["history"][0] is loaded["history"][1] and torch.equal(loaded["model"]["w"], torch.ones(3))
    assert (tmp_path / "dag.pt").stat().st_size < 10_000


BUILD_ON_POSIXPATH = (b"\x80\x02cpathlib\nPosixPath\nN}X\x0b\x00\x00\x00__truediv__ccollections\nOrderedDict\ns"
                      b"\x86b.")


def test_allow_list_unpickler_never_builds_a_class(tmp_path):
    before = dict(vars(pathlib.PosixPath))
    (tmp_path / ".metadata").write_bytes(BUILD_ON_POSIXPATH)
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"applies state \(BUILD\) to `PosixPath`"):
            load_dcp_metadata(tmp_path / ".metadata")
        assert dict(vars(pathlib.PosixPath)) == before
        assert str(pathlib.Path("a") / "b") == "a/b"
    finally:  # on the old code the class is changed: put it back, or every later test breaks
        for name in set(vars(pathlib.PosixPath)) - set(before):
            delattr(pathlib.PosixPath, name)


@pytest.mark.parametrize("opcodes", [
    b"ccollections\nOrderedDict\nX\x01\x00\x00\x00kX\x01\x00\x00\x00vs.",  # SETITEM on the class
    b"cbuiltins\nset\n(X\x01\x00\x00\x00k\x90.",  # ADDITEMS on the class
    b"ctorch\nfloat32\nN}X\x01\x00\x00\x00kK\x01s\x86b.",  # BUILD on a global instance
])
def test_allow_list_unpickler_changes_no_global(tmp_path, opcodes):
    (tmp_path / ".metadata").write_bytes(b"\x80\x04" + opcodes)
    with pytest.raises(UnsafeCheckpointError, match="which it did not construct"):
        load_dcp_metadata(tmp_path / ".metadata")
    assert not hasattr(torch.float32, "k")


def test_allow_list_unpickler_still_reads_real_metadata(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "opt": {"lr": 0.1, "betas": (0.9, 0.99)}},
             checkpoint_id=tmp_path, no_dist=True)
    assert load_dcp_metadata(tmp_path / ".metadata") == pickle.loads((tmp_path / ".metadata").read_bytes())
