"""The plain-file operations of the :class:`~lightning_fsdp.checkpoint.io.store.Store` interface on a remote store
(Hugging Face weights at a URL, read in place), and its ``clean``: a mixin of ``FsspecStore``, kept apart from
:mod:`.remote`, whose save and load protocol changes on its own.

Each operation is one request (a LIST, a HEAD, a GET; ``read_ranges``: several GETs in flight at once), retried
within the store's one bound and explained with the URL (:mod:`.remote_errors`). A ``read`` always sends a range: an
un-ranged ``cat_file`` of s3fs first asks for the object's size (a HEAD) when it may split the GET.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError, unreadable
from lightning_fsdp.checkpoint.io import remote_clean
from lightning_fsdp.checkpoint.io.remote_clean import Swept
from lightning_fsdp.checkpoint.io.remote_errors import retrying
from lightning_fsdp.checkpoint.io.urls import join

__all__ = ["RemoteOps"]


class RemoteOps:
    """Needs of its class (``FsspecStore``): ``fs`` (the fsspec filesystem), ``target(path)`` (the normalized URL),
    ``read_commit``, ``_missing_bucket`` and ``_retrying``."""

    fs: Any
    target: Callable[[Any], str]
    read_commit: Callable[[str], Optional[dict[str, Any]]]
    _missing_bucket: Callable[[str], Optional[FileNotFoundError]]
    _retrying: Callable[[str, str, Callable[[], Any]], Any]

    def listing(self, directory: Any) -> Optional[dict[str, int]]:
        """One LIST, fresh (not fsspec's cached listing): the objects directly under ``directory/``."""
        url = self.target(directory)
        fs = self.fs

        def ls() -> Optional[list[dict[str, Any]]]:
            fs.invalidate_cache(url)
            try:
                return fs.ls(url, detail=True)
            except FileNotFoundError:
                return None

        entries = retrying(fs, url, "listing", ls)
        if entries is None:
            return None
        own = fs._strip_protocol(url).rstrip("/")
        files = {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: int(e.get("size") or 0) for e in entries
                 if e.get("type") == "file" and fs._strip_protocol(str(e["name"])).rstrip("/") != own}
        # A listing of an object's own name gives that object alone (s3fs): a file, no directory.
        if not files and any(fs._strip_protocol(str(e["name"])).rstrip("/") == own for e in entries):
            return None
        return files

    def size(self, path: Any) -> Optional[int]:
        """One HEAD."""
        url = self.target(path)
        fs = self.fs

        def info() -> Optional[int]:
            fs.invalidate_cache(url)
            try:
                found = fs.info(url)
            except FileNotFoundError:
                return None
            return int(found["size"]) if found.get("type") == "file" else None

        return retrying(fs, url, "reading", info)

    def read(self, path: Any, start: int = 0, end: Optional[int] = None) -> bytes:
        url = self.target(path)
        if end is not None and end <= start:
            return b""
        return retrying(self.fs, url, "reading", lambda: self.fs.cat_file(url, start=start, end=end))

    def read_ranges(self, paths: Sequence[Any], starts: Sequence[int], ends: Sequence[int]) -> list[bytes]:
        urls = [self.target(p) for p in paths]
        if not urls:
            return []
        datas = retrying(self.fs, urls[0], "reading",
                         lambda: self.fs.cat_ranges(urls, list(starts), list(ends), on_error="return"))
        for i, (url, start, end) in enumerate(zip(urls, starts, ends)):
            if isinstance(datas[i], BaseException):  # that range alone again, within the bound (an outage: explained)
                datas[i] = self.read(url, start, end)
            if len(datas[i]) != end - start:
                raise unreadable(url, OSError(f"bytes {start}-{end} could not be read ({len(datas[i])} bytes of"
                                              f" {end - start})"))
        return datas

    def index_entries(self, directory: Any, index: Any, weight_map: Mapping[str, Any]) -> list[str]:
        """An entry must be a plain relative name of a ``.safetensors`` object under the URL (no scheme, no leading
        ``/``, no ``..``), as ``save_pretrained`` writes them: an object store has no symlinks to follow, and a
        ``..`` would name another prefix."""
        url, index = self.target(directory), str(index)
        names = sorted({str(name) if isinstance(name, str) else repr(name) for name in weight_map.values()})
        bad = [n for n in names if not n.endswith(".safetensors") or n.startswith("/") or "://" in n
               or ".." in n.split("/")]
        if bad:
            raise ValueError(
                f"the index {index!r} names objects outside {url!r} or not safetensors files: {bad[:5]}. Allowed: a"
                " '.safetensors' name relative to the checkpoint URL that stays under it. HINT: name the files by"
                " their plain file names in 'weight_map', as `save_pretrained` writes them."
            )
        return [join(url, n) for n in names]

    def clean(self, path: Any, grace_s: Optional[float] = None) -> Swept:
        """Remove what saves that never committed left at the checkpoint ``path`` (``lightning-fsdp clean URL``): the
        token prefixes no COMMIT names whose newest object (and multipart upload) is older than ``grace_s`` (default
        :data:`.remote_clean.GRACE_S`) by the store's clock, with their incomplete multipart uploads. The committed
        checkpoint, younger tokens (a save may still be uploading) and every object no save of this project wrote
        stay. Returns what was removed (``.kept``: the younger tokens; ``.found``: whether any token was there)."""
        target = self.target(path)
        grace = remote_clean.GRACE_S if grace_s is None else float(grace_s)

        def run() -> Swept:
            missing = self._missing_bucket(target)
            if missing is not None:
                raise missing
            try:
                record = self.read_commit(target)
            except (CheckpointError, ValueError) as err:
                why = getattr(err.__cause__, "why", None) or str(err)
                raise type(err)(f"The COMMIT of {target!r} cannot be read ({why}), so `clean` cannot tell the"
                                " committed save's objects from leftovers, and removed nothing. HINT: save to that URL"
                                " again (a save replaces its COMMIT), or remove the checkpoint yourself.") from err
            swept = remote_clean.sweep(self.fs, target, None if record is None else record["token"], grace)
            swept.checkpoint = record is not None
            return swept
        return self._retrying(target, "cleaning", run)
