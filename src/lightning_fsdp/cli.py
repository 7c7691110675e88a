"""The ``lightning-fsdp`` command (also ``python -m lightning_fsdp``): inspect and convert checkpoints, and plan
the memory of a run before launching it.

    lightning-fsdp inspect PATH [--tensors] [--json] [--verify] [--storage-option KEY=VALUE ...]
    lightning-fsdp convert SRC DST --to full|sharded|safetensors [--max-shard-size 500MB] [--model KEY]
                           [--strip-prefix PREFIX] [--overwrite] [--storage-option KEY=VALUE ...]
    lightning-fsdp clean URL [--grace DURATION] [--storage-option KEY=VALUE ...]
    lightning-fsdp plan --model MODULE:FACTORY --inputs MODULE:FACTORY --world-size N [strategy options] [--json]

``plan`` is :mod:`lightning_fsdp.planner.command`.

PATH, SRC and DST may be URLs (``s3://bucket/run/step-3``, ``gs://``, ``az://``, any fsspec protocol): a checkpoint
there is the committed one (:mod:`lightning_fsdp.checkpoint.io.remote`), fetched and checked as a load does, and a
conversion to a URL commits there as a save does. Endpoint and credentials come from the environment as the
filesystem reads them (for S3: ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), or from ``--storage-option
KEY=VALUE`` (passed to fsspec; VALUE is read as JSON where it parses, so ``use_ssl=false`` is a boolean). ``clean``
removes what unfinished saves left at a checkpoint URL (objects no commit names, once older than ``--grace``, and
their incomplete multipart uploads), and stale local staging folders (:mod:`.checkpoint.io.remote_clean`).

It runs in one process, without a process group, and streams tensors (see :mod:`lightning_fsdp.checkpoint.convert`
for what it holds in memory). Exit status: 0 on success; 2 for input the user can fix (a missing or non-checkpoint
path, an existing DST without ``--overwrite``, a bad option, a file whose bytes do not parse), with one line on
stderr that names the problem and the fix; 1 when the system fails the conversion (a full disk, a permission), or when ``inspect --verify`` finds
any file damaged (bytes that do not match their checksums, a full file cut short) or missing, or when a checkpoint
URL's ``COMMIT`` object is damaged (any command), also as one line; 130 when interrupted.
A DST is only ever replaced by a complete conversion, so a failed or interrupted one leaves it as it was.

The progress bar (tqdm) goes to stderr while ``convert`` runs, when stderr is a terminal and the conversion takes
more than a second; ``--progress`` shows it at once and anyway (in a log file, say) and ``--no-progress`` hides it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import zipfile
from typing import Any, Callable, Iterator, Optional

from lightning_fsdp.checkpoint.convert import (
    FORMATS,
    UsageError,
    convert,
    describe,
    export_prefix,
    open_checkpoint,
    source_commit_order,
)
from lightning_fsdp.checkpoint.integrity.agreement import CheckpointError
from lightning_fsdp.checkpoint.integrity.digests import ChecksumError
from lightning_fsdp.checkpoint.integrity.verify import verify_checkpoint
from lightning_fsdp.checkpoint.io.store import store_for
from lightning_fsdp.planner.command import add_plan_command, byte_size, positive_int

__all__ = ["main"]

PROG = "lightning-fsdp"


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return args.run(args)
    except UsageError as err:
        return _fail(str(err), 2)
    except CheckpointError as err:  # bytes that do not parse: its message names the file and the fix
        return _fail(str(err), 1 if _damaged_commit(err) else 2)
    except OSError as err:
        if "HINT:" in str(err):  # a store's error: it names the URL and the fix already
            return _fail(_said(err), getattr(err, "cli_status", 1))
        return _fail(f"{err}. HINT: check that SRC is readable and that DST's directory is writable and has free"
                     " space, then run the command again.", 1)
    except (ValueError, RuntimeError) as err:
        if "HINT:" not in str(err):
            raise  # not an error of ours that says its fix: a bug, with its traceback to report
        # Ours, said with the fix: a bad setting (LFSDP_STORE_TIMEOUT_S, ...) is bad input; a store that failed in a
        # way with no OSError of its own (a bucket name the client refuses, a folder where COMMIT should be) is 1.
        return _fail(str(err), 2 if isinstance(err, ValueError) else 1)
    except KeyboardInterrupt:
        return _fail("interrupted; no output was changed.", 130)


def _damaged_commit(err: BaseException) -> bool:
    """A checkpoint's COMMIT object found damaged (cut short, flipped, edited, crafted): damage, status 1, as a failed
    verification is; the store's error is chained to the reader's (once more where every rank raised it)."""
    from lightning_fsdp.checkpoint.formats.commit_record import CommitRecordError

    seen: Optional[BaseException] = err
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, CommitRecordError):
            return seen.damage
        seen = seen.__cause__
    return False


def _said(err: OSError) -> str:
    """An OSError's own words, without Python's ``[Errno 2]`` in front."""
    return err.strerror if isinstance(err.strerror, str) and err.filename is None else str(err)


def _fail(message: str, status: int) -> int:
    print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
    return status


class _Parser(argparse.ArgumentParser):
    """argparse prints the usage and the error on several lines; ours is one line, like every other error."""

    def error(self, message: str) -> None:  # type: ignore[override]
        if "HINT:" in message:  # an option's own message (from its type=) already says what to do
            raise UsageError(message)
        raise UsageError(f"{message}. HINT: see `{self.prog} --help`.")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Inspect and convert lightning-fsdp checkpoints (full and sharded), and plan"
                                            " the memory of a run before launching it.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{inspect,convert,plan,clean,lighthouse}")

    inspect = commands.add_parser("inspect", help="show what a checkpoint holds",
                                  description="Show a checkpoint's format, world size, models, optimizers and"
                                              " metadata. Reads metadata only.")
    inspect.add_argument("path", metavar="PATH", help="a full checkpoint file or a sharded checkpoint directory")
    inspect.add_argument("--tensors", action="store_true", help="also list every tensor's name, shape and dtype")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of text")
    inspect.add_argument("--verify", action="store_true",
                         help="also check every byte against the checksums recorded at save (reads the whole"
                              " checkpoint, loads nothing into a model); exit status 1 on a mismatch")
    _add_allow_pickle(inspect)
    _add_storage_options(inspect)
    inspect.set_defaults(run=_inspect)

    add_plan_command(commands)

    conv = commands.add_parser("convert", help="convert a checkpoint to another format",
                               description="Convert between full and sharded checkpoints, or export model weights"
                                           " to safetensors. Streams tensors; DST appears only once complete. A"
                                           " converted checkpoint keeps SRC's commit order (the order `latest`,"
                                           " resume and retention follow): a copy is not a new save, so it does not"
                                           " become the newest checkpoint where it lands; a SRC that records none"
                                           " gives a DST that records none (it sorts by step). A safetensors export"
                                           " to a URL stays a plain Hugging Face folder; --overwrite replaces the"
                                           " previous export's files (entry point last, then its old shards), and"
                                           " leaves every other file there.")
    conv.add_argument("src", metavar="SRC", help="a full checkpoint file or a sharded checkpoint directory")
    conv.add_argument("dst", metavar="DST", help="where to write the result")
    conv.add_argument("--to", required=True, choices=FORMATS,
                      help="full: one torch.save file; sharded: a DCP directory plus meta.pt; safetensors: model"
                           " weights only, one file if DST ends in .safetensors, else a directory")
    conv.add_argument("--max-shard-size", type=byte_size, metavar="SIZE",
                      help="safetensors only: split the weights into shards of at most SIZE (e.g. 500MB, 2GiB) plus"
                           " model.safetensors.index.json; peak memory is about one shard")
    conv.add_argument("--model", metavar="KEY",
                      help="safetensors only: export just this model, with unprefixed names (default: every model,"
                           " names prefixed with the model's key when there are several)")
    conv.add_argument("--strip-prefix", metavar="PREFIX",
                      help="safetensors only: remove PREFIX from every weight name, e.g. `model.` for a Trainer"
                           " checkpoint whose LightningModule holds the Hugging Face model as `self.model`. Default:"
                           " detected for Trainer checkpoints whose names all start with one attribute; '' keeps"
                           " the names")
    conv.add_argument("--overwrite", action="store_true", help="replace DST if it exists (never non-checkpoint files)")
    conv.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                      help="show a progress bar on stderr (default: when stderr is a terminal)")
    _add_allow_pickle(conv)
    _add_storage_options(conv)
    conv.set_defaults(run=_convert)

    clean = commands.add_parser("clean", help="remove what unfinished saves left at a checkpoint URL",
                                description="Remove the objects of saves that never committed at a checkpoint URL"
                                            " (the .<token>/ prefixes its COMMIT does not name, once nothing in one"
                                            " is newer than --grace by the store's clock), with their incomplete"
                                            " multipart uploads, and this host's staging folders of saves and loads"
                                            " whose process is gone. The committed checkpoint, younger saves (maybe"
                                            " still uploading) and every object no save wrote stay.")
    clean.add_argument("url", metavar="URL", help="a checkpoint URL, e.g. s3://bucket/run/step-3")
    clean.add_argument("--grace", type=_grace, default=None, metavar="DURATION",
                       help="leave a save's objects until they are this old: seconds (3600) or with a unit (90s, 30m,"
                            " 2h, 1d); at least the longest a save takes. Default: 1h")
    _add_storage_options(clean)
    clean.set_defaults(run=_clean)
    house = commands.add_parser("lighthouse", help="serve torchft's lighthouse for fault-tolerant replica groups",
                                description="Serve the lighthouse that the replica groups of a fault-tolerant job"
                                            " meet at each step (torchft's quorum server), until Ctrl-C or SIGTERM."
                                            " It prints its address: give it to every group as TORCHFT_LIGHTHOUSE."
                                            " Needs the [ft] extra.")
    house.add_argument("--min-replicas", type=positive_int("--min-replicas 2"), required=True, metavar="N",
                       help="the fewest replica groups a quorum needs to go on")
    house.add_argument("--bind", default="[::]:29510", metavar="HOST:PORT",
                       help="where to listen. Default: [::]:29510 (port 0: any free port)")
    house.add_argument("--join-timeout-ms", type=positive_int("--join-timeout-ms 60000"), default=60_000, metavar="MS",
                       help="how long a quorum waits for groups beyond --min-replicas. Default: 60000")
    house.add_argument("--heartbeat-timeout-ms", type=positive_int("--heartbeat-timeout-ms 5000"), default=5_000,
                       metavar="MS", help="how long a silent group still counts as live. Default: 5000")
    house.set_defaults(run=_lighthouse)
    return parser


def _lighthouse(args: argparse.Namespace) -> int:
    from lightning_fsdp.engine.fault_tolerance.lighthouse import serve

    try:
        serve(args.min_replicas, bind=args.bind, join_timeout_ms=args.join_timeout_ms,
              heartbeat_timeout_ms=args.heartbeat_timeout_ms, announce=lambda line: print(line, flush=True))
    except ModuleNotFoundError as err:
        raise UsageError(str(err)) from err
    return 0


def _add_allow_pickle(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-pickle", action="store_true",
                        help="unpickle entries that are not tensors or plain data; this can run arbitrary code, so"
                             " use it only for checkpoints you trust")


def _add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage-option", action="append", type=_storage_option, default=[], metavar="KEY=VALUE",
                        dest="storage_options",
                        help="for a URL: an fsspec filesystem option, e.g. endpoint_url=http://host:9000 (repeat for"
                             " more; VALUE is read as JSON where it parses). Default: the environment's settings")


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(
            f"Invalid storage option {text!r}. Allowed: --storage-option KEY=VALUE, an fsspec filesystem option."
            " HINT: e.g. `--storage-option endpoint_url=http://localhost:9000`")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _grace(text: str) -> float:
    number, unit = (text[:-1], text[-1]) if text[-1:] in _UNITS else (text, "s")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(
            f"Invalid --grace {text!r}. Allowed: a duration >= 0, in seconds (3600) or with a unit s, m, h or d"
            " (30m, 2h). HINT: give at least the longest a save to that URL takes, e.g. `--grace 2h`")
    return value


def _options(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    return dict(args.storage_options) or None


@contextlib.contextmanager
def _readable(path: str, options: Optional[dict[str, Any]]) -> Iterator[str]:
    """A local path to read the checkpoint at ``path`` from, for the time of the block: a local path as given (so the
    command reads exactly what the user named), or for a URL the committed checkpoint, fetched and size- and
    digest-checked by its store. A URL never becomes a ``Path``: that would fold ``s3://`` into ``s3:/``."""
    try:
        opened = store_for(path, options).local_copy(path)  # a local path: itself; a URL: every object, fetched
        local = opened.__enter__()
    except FileNotFoundError as err:
        if err.errno is not None:  # no checkpoint at that URL (the store's message names it and the fix): input the
            err.cli_status = 2  # type: ignore[attr-defined]  # user can fix, status 2 as for a missing path
        raise
    try:
        yield str(local)
    except BaseException:
        if not opened.__exit__(*sys.exc_info()):
            raise
    else:
        opened.__exit__(None, None, None)


def _inspect(args: argparse.Namespace) -> int:
    try:
        store = store_for(args.path, _options(args))
        # A URL is verified where it is, streamed (issue 43): damage is found before anything is copied, and the
        # copy below is not verified again.
        try:
            streamed = store.verify(args.path) if args.verify and store.remote else None
        except FileNotFoundError as err:
            if err.filename is None:  # no checkpoint at that URL: input the user can fix, as for a missing path
                err.cli_status = 2  # type: ignore[attr-defined]
                raise
            return _fail(f"{err.filename!r} is missing, though the checkpoint was saved with it. {_DAMAGED}", 1)
        with _readable(args.path, _options(args)) as local:
            return _inspect_local(args, local, streamed)
    except ChecksumError as err:  # an object that does not match its commit record: damaged, as a shard would be
        return _fail(str(err), 1 if args.verify else 2)


def _inspect_local(args: argparse.Namespace, path: str, streamed: Optional[bool] = None) -> int:
    try:
        source = open_checkpoint(path, allow_pickle=args.allow_pickle)
    except (UsageError, CheckpointError) as err:
        # Opening reads meta.pt and .metadata, checked against their digests: with --verify, a file that fails its
        # checksum is a failed verification (status 1), as a damaged shard is, not unreadable input (status 2).
        # A file that begins as a zip archive but does not open as one was cut short: damaged, not the wrong input.
        failed_checksum = err if isinstance(err, ChecksumError) else err.__cause__
        if args.verify and isinstance(failed_checksum, ChecksumError):
            return _fail(_as_given(err, path, args.path), 1)
        if args.verify and _cut_short_zip(path):
            return _fail(f"{args.path!r} begins as a torch.save zip archive but does not open as one: it was cut short"
                         f" (truncated). {_DAMAGED}", 1)
        raise
    info = describe(source, tensors=args.tensors)
    info["path"] = info["path"] if path == args.path else args.path  # a URL, not the local copy read from it
    if args.verify:
        try:
            info["checksums"] = "verified" if (verify_checkpoint(path) if streamed is None else streamed) else "none"
        except ChecksumError as err:
            return _fail(_as_given(err, path, args.path), 1)
        except FileNotFoundError as err:  # a shard that `.metadata` names is gone: a failed verification too
            return _fail(_as_given(f"{err.filename!r} is missing, though the checkpoint was saved with it. {_DAMAGED}",
                                   path, args.path), 1)
    print(json.dumps(info, indent=2) if args.json else _render(info))
    return 0


def _as_given(message: Any, local: str, given: str) -> str:
    """``message`` naming the checkpoint as the user gave it (a URL), not the local copy it was read from."""
    return str(message).replace(local, given)


_DAMAGED = "HINT: the checkpoint is damaged; load an earlier one, or save this one again."


def _cut_short_zip(path: str) -> bool:
    """A file that begins with a zip archive's first header but whose archive does not open (its end is missing)."""
    try:
        with open(path, "rb") as file:
            return file.read(4) == b"PK\x03\x04" and not zipfile.is_zipfile(path)
    except OSError:  # a directory, or unreadable: not a cut-short file
        return False


def _convert(args: argparse.Namespace) -> int:
    with _readable(args.src, _options(args)) as local:
        # The order is read where the source is (a URL's COMMIT), not from the local copy of its objects.
        order = None if args.to == "safetensors" else source_commit_order(args.src, _options(args))
        # DST's store takes the result: a local rename, or a URL's commit (whole or not at all; an existing checkpoint
        # stays until the new one commits) recording the source's commit order; a safetensors export to a URL is
        # plain objects, its entry point written last (:mod:`lightning_fsdp.checkpoint.convert`).
        return _convert_local(args, local, args.dst, commit_order=order, storage_options=_options(args))


def _convert_local(args: argparse.Namespace, src: str, dst: str, report: bool = True, *, commit_order: Optional[int],
                   storage_options: Optional[dict[str, Any]] = None) -> int:
    source: Any = src
    prefix, what = args.strip_prefix, ""
    if args.to == "safetensors":
        # Open first to settle the names, so the report says exactly what the export did.
        source = open_checkpoint(src, allow_pickle=args.allow_pickle)
        prefix, what = export_prefix(source, model=args.model, strip_prefix=args.strip_prefix)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    bar = _bar(args.to, immediate=bool(args.progress)) if show else None
    try:
        target = convert(source, dst, to=args.to, max_shard_size=args.max_shard_size, model=args.model,
                         overwrite=args.overwrite, allow_pickle=args.allow_pickle, progress=bar,
                         strip_prefix=prefix, commit_order=commit_order, storage_options=storage_options)
    except OSError as err:
        if err.filename is None and err.errno is not None:  # DCP's writers report a full disk without the file
            raise OSError(err.errno, f"{err.strerror} while writing {args.dst!r}") from err
        raise
    finally:
        if bar is not None:
            bar.close()
    if report:
        print(f"wrote {target} ({args.to}{'; ' + what if what else ''})")
    return 0


def _clean(args: argparse.Namespace) -> int:
    from lightning_fsdp.checkpoint.io.remote_clean import remove_stale_staging

    try:
        removed = store_for(args.url, _options(args)).clean(args.url, grace_s=args.grace)  # a local path: UsageError
    except FileNotFoundError as err:
        if err.errno is not None:  # a missing bucket: input the user can fix, status 2 as for a missing path
            err.cli_status = 2  # type: ignore[attr-defined]
        raise
    for url in removed:
        print(f"removed {url}")
    for url in removed.kept:
        print(f"kept {url} (newer than --grace: maybe a save still uploading)")
    for folder in remove_stale_staging():
        print(f"removed {folder} (a staging folder of this host whose process is gone)")
    if not removed.found and not removed.checkpoint:
        print(f"{args.url}: nothing to clean: no checkpoint and no leftovers of a save there; nothing was removed")
    else:
        print(f"{args.url}: {len(removed)} leftover{'s' if len(removed) != 1 else ''} removed"
              + ("; the committed checkpoint stays" if removed.checkpoint else ""))
    return 0


def _render(info: dict[str, Any]) -> str:
    world = f"{info['world_size']}" if info["format"] == "sharded" else "1 (single file)"
    lines = [f"checkpoint   {info['path']}", f"format       {info['format']}", f"world size   {world}"]
    if not info["models"]:
        lines.append("models       (none)")
    for key, model in info["models"].items():
        lines.append(f"model        {key}: {model['parameters']:,} parameters, {_bytes(model['bytes'])}")
        for dtype, counts in model["dtypes"].items():
            parameters, size = counts["parameters"], _bytes(counts["bytes"])
            lines.append(f"               {dtype:<10} {parameters:>15,} parameters  {size}")
    if not info["optimizers"]:
        lines.append("optimizers   (none)")
    for key, opt in info["optimizers"].items():
        groups = opt["param_groups"]
        lines.append(f"optimizer    {key}: {opt['state_tensors']:,} state tensors, {_bytes(opt['bytes'])},"
                     f" {groups} param group{'s' if groups != 1 else ''}")
    lines.append(f"metadata     {', '.join(info['metadata_keys']) or '(none)'}")
    if "checksums" in info:
        lines.append("checksums    " + ("verified: every byte matches the checksums recorded at save"
                                      if info["checksums"] == "verified" else
                                      "NONE: this checkpoint carries no checksums (saved before they were"
                                      " recorded), so nothing was verified"))
    if "tensors" in info:
        lines.append("tensors")
        width = max((len(t["name"]) for t in info["tensors"]), default=0)
        for t in info["tensors"]:
            lines.append(f"  {t['name']:<{width}}  {str(t['shape']):<16} {t['dtype']}")
    return "\n".join(lines)


def _bytes(count: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if count < 1000:
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"


class _TqdmProgress:
    """The ``(done, total)`` progress callback of :func:`convert`, drawn by tqdm on stderr in bytes."""

    def __init__(self, label: str, delay: float) -> None:
        from tqdm import tqdm  # Lightning depends on tqdm

        self._bar = tqdm(desc=label, unit="B", unit_scale=True, unit_divisor=1000, delay=delay, file=sys.stderr,
                         dynamic_ncols=True, leave=True)

    def __call__(self, done: int, total: int) -> None:
        if self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        self._bar.close()


def _bar(label: str, *, immediate: bool) -> Callable[[int, int], None]:
    # On a terminal, a conversion of a moment shows nothing; `--progress` shows the bar at once.
    return _TqdmProgress(label, delay=0.0 if immediate else 1.0)
