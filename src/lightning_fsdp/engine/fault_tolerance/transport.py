"""The heal wire: state sent from a live replica group to one that rejoins, as a JSON header plus raw tensor bytes.

torchft's own transports unpickle what a peer sends (its HTTP transport with ``weights_only=False``, its process-group
transport for the metadata and every DTensor spec), and this project promises that no code from outside runs in a
training process. So nothing here pickles or unpickles, and no ``torch.load`` sees a byte from the network: a header
is ``json.loads`` and a walk over a small closed set of node forms, and a tensor is a ``uint8`` buffer received into
memory the receiver allocated from a header it has checked.

Tree nodes (the header's ``tree``): null, true/false, an int and a str are themselves; a float is ``{"f": 16 hex
digits}`` (its IEEE-754 bits, so NaN payloads, -0.0 and inf come back bit for bit); ``{"l": [...]}`` a list, ``{"t":
[...]}`` a tuple, ``{"d": [[key, node], ...]}`` a dict (int or str keys, in order), ``{"x": i}`` tensor ``i`` and
``{"dx": i}`` the local shard of a DTensor (received as a :class:`LocalShard`; the loader rewraps it with its own
parameter's mesh and placements, so no DeviceMesh crosses the wire).

The exchange with one receiver, over any ``ProcessGroup`` with tagged ``send``/``recv`` (a gloo group, torchft's
``ProcessGroupGloo``): tag 1 the header's length (int64), tag 2 the header (uint8), then the receiver's verdict on tag
3 the other way (int64: 0 accepted, else the reason), and only if accepted tags 4.. the tensor bytes. So a refused
header (another step, another layout, a malformed one) is an error on both sides before any tensor byte moves.
Tensors over ``SMALL`` bytes go one message each, as they are (an FSDP2 shard is contiguous: no copy); smaller ones
travel packed, ``ALIGN``-aligned, up to ``PACK`` bytes a message, so an optimizer's thousands of 0-d ``step`` tensors
cost a few messages, not thousands.
"""

from __future__ import annotations

import json
import re
import struct
from datetime import timedelta
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from lightning_fsdp.engine.fault_tolerance.wire_checks import layout_difference, manager_tree_problem

FORMAT = "lightning-fsdp-heal/1"
MAX_HEADER_BYTES = 64 << 20  # a header holds no tensor bytes: 64 MiB is ~1M tensors' worth of specs
MAX_DEPTH = 64  # state dicts nest a few levels; the bound keeps a hostile header from exhausting the stack
SMALL = 64 << 10
PACK = 1 << 20
ALIGN = 16  # every dtype's itemsize divides it, so a packed tensor can be a view of its pack
# torch computes an empty tensor's strides over its other dims (int64): a shape with a 0 next to dims spanning more
# bytes than this is refused, not allocated ("Stride calculation overflowed", or an int that does not fit).
MAX_SPAN = 1 << 62
MAX_COUNT = 1 << 53  # torchft's counters: far above any run, and exact in every JSON reader

# The dtypes a receiver will allocate. Named as torch prints them, without "torch.".
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64, torch.complex128,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    *(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64") if hasattr(torch, n)),
)}
_FLOAT = re.compile(r"[0-9a-f]{16}\Z")
_HEADER_KEYS = {"format", "step", "layout", "tensors", "tree"}
# The receiver's verdict on a header.
ACCEPTED, MALFORMED, OTHER_STEP, OTHER_LAYOUT, TOO_LARGE = range(5)
_LENGTH, _HEADER, _VERDICT, _FIRST = 1, 2, 3, 4  # message tags; the tensor messages are _FIRST, _FIRST + 1, ...
_VERDICTS = {MALFORMED: "malformed", OTHER_STEP: "for another step", OTHER_LAYOUT: "for another layout",
             TOO_LARGE: "larger than allowed"}


class PayloadError(ValueError):
    """A heal payload this side refuses: malformed, for another step or layout, or refused by the peer. ``code`` is
    the verdict sent back to the sender."""

    def __init__(self, message: str, code: int = MALFORMED) -> None:
        super().__init__(message)
        self.code = code


class LayoutMismatch(PayloadError):
    """The sender's model/optimizer layout is not the receiver's (another mesh size, other shapes)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, OTHER_LAYOUT)


class TransferError(RuntimeError):
    """The process group failed while a heal payload moved (a peer died, or the timeout passed)."""


class LocalShard(NamedTuple):
    """The local shard of a DTensor as received; the loader rewraps it with its own parameter's spec."""

    local: torch.Tensor


class Spec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    host: bool  # the sender held it in host memory (an optimizer's `step`): the receiver puts it there too


class Header(NamedTuple):
    step: int
    layout: Any
    specs: list[Spec]
    tree: Any  # the checked JSON node


def _hint(text: str) -> str:
    return (f"{text}. HINT: the heal payload is built by lightning_fsdp.engine.fault_tolerance; both replica groups"
            " must run the same lightning-fsdp version, model, optimizer and group size")


# ---- encoding -------------------------------------------------------------------------------------------------


def freeze(tree: Any, path: str = "state") -> Any:
    """A copy of ``tree`` whose containers are new and whose tensors are the same objects, or a ``TypeError`` naming
    the first value that cannot travel (by its path, e.g. ``state.optimizers.0.param_groups.0.foo``). Taken at a
    window's start, it fixes the plain values while the tensors keep being read in place until they are sent."""
    return _walk(tree, path, 0, lambda t: t)


def _walk(obj: Any, path: str, depth: int, on_tensor) -> Any:
    if depth > MAX_DEPTH:
        raise _cannot(path, f"a value nested deeper than {MAX_DEPTH} levels")
    kind = type(obj)
    if obj is None or kind in (bool, int, float, str):
        return obj
    if isinstance(obj, torch.Tensor):
        if kind not in (torch.Tensor, torch.nn.Parameter) and not _is_dtensor(obj):
            raise _cannot(path, f"a tensor of type {kind.__qualname__} (plain tensors and DTensors can)")
        if obj.layout != torch.strided or str(obj.dtype).removeprefix("torch.") not in DTYPES:
            raise _cannot(path, f"a {obj.layout} tensor of {obj.dtype} (strided tensors of {', '.join(DTYPES)} can)")
        return on_tensor(obj)
    if kind in (list, tuple):
        items = [_walk(v, f"{path}.{i}", depth + 1, on_tensor) for i, v in enumerate(obj)]
        return items if kind is list else tuple(items)
    if kind is dict:
        out = {}
        for key, value in obj.items():
            if type(key) not in (int, str):
                raise _cannot(path, f"the key {key!r} ({type(key).__qualname__}; int and str keys can)")
            out[key] = _walk(value, f"{path}.{key}", depth + 1, on_tensor)
        return out
    raise _cannot(path, f"a value of type {kind.__qualname__} ({obj!r:.80}; None, bool, int, float, str, list, tuple,"
                        " dict with int or str keys and tensors can)")


def _cannot(path: str, what: str) -> TypeError:
    return TypeError(f"{path}: {what} cannot travel in a heal payload. HINT: keep such values out of the state"
                     " dicts (an optimizer's param_groups, a scheduler's attributes), or store them as tensors or plain"
                     " values")


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class _Ref(NamedTuple):
    node: str  # "x" or "dx"
    index: int


def encode(tree: Any, *, step: int, layout: Any) -> tuple[bytes, list[torch.Tensor]]:
    """The header (UTF-8 JSON) and the tensors, in wire order, of ``tree``. A tensor object met twice is sent once
    and comes back as one object."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def tensor_ref(t: torch.Tensor) -> _Ref:
        dtensor = _is_dtensor(t)
        if id(t) not in index:
            index[id(t)] = len(tensors)
            tensors.append((t.to_local() if dtensor else t).detach())
        return _Ref("dx" if dtensor else "x", index[id(t)])

    def node(obj: Any) -> Any:
        kind = type(obj)
        if obj is None or kind in (bool, int, str):
            return obj
        if kind is float:
            return {"f": struct.pack(">d", obj).hex()}
        if kind is _Ref:
            return {obj.node: obj.index}
        if kind is dict:
            return {"d": [[k, node(v)] for k, v in obj.items()]}
        return {"l" if kind is list else "t": [node(v) for v in obj]}

    tree_node = node(_walk(tree, "state", 0, tensor_ref))
    specs = [[str(t.dtype).removeprefix("torch."), list(t.shape), t.numel() * t.element_size(), t.device.type == "cpu"]
             for t in tensors]
    header = json.dumps({"format": FORMAT, "step": step, "layout": layout, "tensors": specs, "tree": tree_node},
                        separators=(",", ":"), allow_nan=False).encode()
    if len(header) > MAX_HEADER_BYTES:
        raise PayloadError(_hint(f"the heal header would be {len(header)} bytes, over the {MAX_HEADER_BYTES} a"
                                 " receiver accepts (too many plain values in the state)"))
    return header, tensors


# ---- decoding -------------------------------------------------------------------------------------------------


def parse_header(raw: bytes, *, step: int, layout: Any, max_bytes: Optional[int] = None,
                 max_tensors: Optional[int] = None) -> Header:
    """Check every field of a received header before anything is allocated from it; any fault is one
    :class:`PayloadError` (a :class:`LayoutMismatch` for another layout) saying what is wrong. ``max_bytes`` bounds
    the tensor bytes, ``max_tensors`` their count (each costs memory even when empty)."""
    if len(raw) > MAX_HEADER_BYTES:
        raise PayloadError(_hint(f"heal header of {len(raw)} bytes, over the {MAX_HEADER_BYTES} accepted"))
    try:
        head = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
        raise PayloadError(_hint(f"heal header is not UTF-8 JSON ({type(err).__name__}: {err})")) from None
    if type(head) is not dict or set(head) != _HEADER_KEYS:
        raise PayloadError(_hint(f"heal header is not an object with the keys {sorted(_HEADER_KEYS)}"))
    if head["format"] != FORMAT:
        raise PayloadError(_hint(f"heal header of format {head['format']!r:.80}, expected {FORMAT!r}"))
    if type(head["step"]) is not int:
        raise PayloadError(_hint(f"heal header's step {head['step']!r:.40} is not an int"))
    if head["step"] != step:
        raise PayloadError(_hint(f"heal payload for step {head['step']!r:.40}, expected step {step}"), OTHER_STEP)
    try:
        same = head["layout"] == layout
    except RecursionError:
        same = False
    if not same:
        raise LayoutMismatch(layout_difference(layout, head["layout"]))
    specs = _specs(head["tensors"], max_bytes, max_tensors)
    used = [False] * len(specs)
    _check_node(head["tree"], used, 0)
    if not all(used):
        raise PayloadError(_hint(f"heal header lists tensor {used.index(False)} that its tree never uses"))
    return Header(step, head["layout"], specs, head["tree"])


def _specs(items: Any, max_bytes: Optional[int], max_tensors: Optional[int]) -> list[Spec]:
    if type(items) is not list:
        raise PayloadError(_hint("heal header's `tensors` is not a list"))
    if max_tensors is not None and len(items) > max_tensors:
        raise PayloadError(_hint(f"heal header lists {len(items)} tensors, over the {max_tensors} this receiver"
                                 " allows"), TOO_LARGE)
    specs, total = [], 0
    for i, item in enumerate(items):
        ok = type(item) is list and len(item) == 4 and type(item[0]) is str and type(item[1]) is list \
            and len(item[1]) <= MAX_DEPTH and all(type(n) is int and n >= 0 for n in item[1]) \
            and type(item[2]) is int and type(item[3]) is bool
        if not ok or item[0] not in DTYPES:
            raise PayloadError(_hint(f"heal header's tensor {i} is not [dtype, shape, nbytes, host] with a dtype of"
                                     f" {', '.join(DTYPES)}: {item!r:.200}"))
        dtype = DTYPES[item[0]]
        numel, span = 1, dtype.itemsize
        for n in item[1]:
            numel, span = numel * n, span * max(n, 1)
        if span > MAX_SPAN:
            raise PayloadError(_hint(f"heal header's tensor {i} has the shape {item[1]!r:.200}, whose dims span over"
                                     f" {MAX_SPAN} bytes of {item[0]}"))
        if item[2] != numel * dtype.itemsize:
            raise PayloadError(_hint(f"heal header's tensor {i} claims {item[2]} bytes for {item[0]} of shape"
                                     f" {item[1]} ({numel * dtype.itemsize} bytes)"))
        total += item[2]
        specs.append(Spec(dtype, tuple(item[1]), item[2], item[3]))
    if max_bytes is not None and total > max_bytes:
        raise PayloadError(_hint(f"heal payload of {total} tensor bytes, over the {max_bytes} this receiver allows"),
                           TOO_LARGE)
    return specs


def _check_node(node: Any, used: list[bool], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise PayloadError(_hint(f"heal header's tree is nested deeper than {MAX_DEPTH} levels"))
    kind = type(node)
    if node is None or kind in (bool, int, str):
        return
    if kind is not dict or len(node) != 1:
        raise PayloadError(_hint(f"heal header's tree holds {node!r:.80}, which is no node form"))
    (form, value), = node.items()
    if form in ("l", "t") and type(value) is list:
        for item in value:
            _check_node(item, used, depth + 1)
    elif form == "d" and type(value) is list:
        keys = set()
        for pair in value:
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) not in (int, str) or pair[0] in keys:
                raise PayloadError(_hint(f"heal header's dict entry {pair!r:.80} is not a [key, node] pair with a"
                                         " new int or str key"))
            keys.add(pair[0])
            _check_node(pair[1], used, depth + 1)
    elif form == "f" and type(value) is str and _FLOAT.match(value):
        pass
    elif form in ("x", "dx") and type(value) is int and 0 <= value < len(used):
        used[value] = True
    else:
        raise PayloadError(_hint(f"heal header's tree holds {node!r:.80}, which is no node form"))


def build(header: Header, tensors: Sequence[torch.Tensor]) -> Any:
    """The tree of a checked header over the tensors received for it."""
    def make(node: Any) -> Any:
        if node is None or type(node) in (bool, int, str):
            return node
        (form, value), = node.items()
        if form == "f":
            return struct.unpack(">d", bytes.fromhex(value))[0]
        if form == "x":
            return tensors[value]
        if form == "dx":
            return LocalShard(tensors[value])
        if form == "d":
            return {key: make(item) for key, item in value}
        items = [make(item) for item in value]
        return items if form == "l" else tuple(items)

    return make(header.tree)


# ---- the wire -------------------------------------------------------------------------------------------------


def plan(sizes: Sequence[int]) -> list[list[tuple[int, int]]]:
    """Messages of the tensor bytes, each a list of (tensor index, offset in the message); sender and receiver
    compute it alike from the header's sizes. Empty tensors travel in no message."""
    messages: list[list[tuple[int, int]]] = []
    pack: list[tuple[int, int]] = []
    end = 0
    for i, size in enumerate(sizes):
        if size == 0:
            continue
        if size > SMALL:
            messages.append([(i, 0)])
            continue
        start = -(-end // ALIGN) * ALIGN
        if pack and start + size > PACK:
            messages.append(pack)
            pack, start = [], 0
        pack.append((i, start))
        end = start + size
    if pack:
        messages.append(pack)
    return messages


def _message_size(message: list[tuple[int, int]], sizes: Sequence[int]) -> int:
    index, offset = message[-1]
    return offset + sizes[index]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _wait(work, timeout: Optional[timedelta], what: str) -> None:
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout)
    except Exception as err:  # gloo raises RuntimeError (peer gone, timeout); torchft's wrappers their own
        raise TransferError(f"The heal transfer failed while it {what}: {err}. HINT: the peer replica group died or"
                            " stalled; the next quorum leaves it out and healing starts again") from err


def send(pg, dst: int, header: bytes, tensors: Sequence[torch.Tensor], *, device: torch.device = torch.device("cpu"),
         timeout: Optional[timedelta] = None) -> int:
    """Send one encoded payload to rank ``dst`` of ``pg``; returns the bytes sent. Raises :class:`PayloadError` when
    the receiver refuses the header (it raises its own reason), :class:`TransferError` when the group fails."""
    length = torch.tensor([len(header)], dtype=torch.int64, device=device)
    body = torch.frombuffer(bytearray(header), dtype=torch.uint8).to(device)
    verdict = torch.zeros(1, dtype=torch.int64, device=device)
    works = [pg.send([length], dst, _LENGTH), pg.send([body], dst, _HEADER)]
    _wait(pg.recv([verdict], dst, _VERDICT), timeout, f"waited for rank {dst}'s verdict on the heal header")
    if int(verdict.item()) != ACCEPTED:  # a refused length leaves its header unreceived: its work is abandoned
        reason = _VERDICTS.get(int(verdict.item()), f"refused (code {int(verdict.item())})")
        raise PayloadError(_hint(f"rank {dst} refused the heal payload: {reason}; its own error says more"))
    for work in works:
        _wait(work, timeout, f"sent the heal header to rank {dst}")
    sizes = [t.numel() * t.element_size() for t in tensors]
    sent = 8 + len(header)
    for k, message in enumerate(plan(sizes)):
        if len(message) == 1 and sizes[message[0][0]] > SMALL:
            buffer = _flat(tensors[message[0][0]]).to(device)
        else:
            buffer = torch.zeros(_message_size(message, sizes), dtype=torch.uint8, device=device)
            for i, offset in message:
                buffer[offset:offset + sizes[i]].copy_(_flat(tensors[i]))
        # One message in flight at a time: a copied buffer is freed before the next is made.
        _wait(pg.send([buffer], dst, _FIRST + k), timeout, f"sent message {k} of the heal payload to rank {dst}")
        sent += buffer.numel()
    return sent


def receive(pg, src: int, *, step: int, layout: Any, device: torch.device = torch.device("cpu"),
            timeout: Optional[timedelta] = None, max_bytes: Optional[int] = None, max_tensors: Optional[int] = None,
            check: Optional[Callable[[Header], None]] = None) -> tuple[Any, int]:
    """Receive one payload from rank ``src`` of ``pg``: (its tree, the bytes received). The header is checked (and
    given to ``check``, which raises :class:`PayloadError`) before anything is allocated from it; a refused header is
    answered with the reason, then raised here."""
    length = torch.zeros(1, dtype=torch.int64, device=device)
    _wait(pg.recv([length], src, _LENGTH), timeout, f"waited for the heal header's length from rank {src}")
    size = int(length.item())
    if not 0 < size <= MAX_HEADER_BYTES:
        _refuse(pg, src, MALFORMED, device, timeout)
        raise PayloadError(_hint(f"heal header of {size} bytes announced by rank {src}; accepted: 1 to"
                                 f" {MAX_HEADER_BYTES}"))
    raw = torch.empty(size, dtype=torch.uint8, device=device)
    _wait(pg.recv([raw], src, _HEADER), timeout, f"received the heal header from rank {src}")
    try:
        header = parse_header(raw.cpu().numpy().tobytes(), step=step, layout=layout, max_bytes=max_bytes,
                              max_tensors=max_tensors)
        if check is not None:
            check(header)
    except PayloadError as err:
        _refuse(pg, src, err.code, device, timeout)
        raise
    _wait(pg.send([torch.zeros(1, dtype=torch.int64, device=device)], src, _VERDICT), timeout,
          f"accepted the heal header of rank {src}")
    sizes = [spec.nbytes for spec in header.specs]
    tensors: list[Optional[torch.Tensor]] = [None] * len(sizes)
    received = 8 + size
    not_bool: list[int] = []
    for k, message in enumerate(plan(sizes)):
        buffer = torch.empty(_message_size(message, sizes), dtype=torch.uint8, device=device)
        _wait(pg.recv([buffer], src, _FIRST + k), timeout, f"received message {k} of the heal payload from rank {src}")
        received += buffer.numel()
        for i, offset in message:
            raw = buffer[offset:offset + sizes[i]]
            if header.specs[i].dtype == torch.bool and bool((raw > 1).any()):  # no bool torch can hold
                not_bool.append(i)
            tensors[i] = _typed(raw, header.specs[i],
                                packed=len(message) > 1 or sizes[i] <= SMALL)
    # Raised once every message is in, so that the sender is never left blocked on a message nobody receives.
    if not_bool:
        raise PayloadError(_hint(f"heal tensor {not_bool[0]} is bool but holds bytes other than 0 and 1"))
    for i, spec in enumerate(header.specs):
        if tensors[i] is None:
            tensors[i] = torch.empty(spec.shape, dtype=spec.dtype, device="cpu" if spec.host else device)
    return build(header, tensors), received


def _typed(raw: torch.Tensor, spec: Spec, *, packed: bool) -> torch.Tensor:
    t = raw.view(spec.dtype).reshape(spec.shape)
    if packed:  # a tensor of its own, as the sender had: torch.set_rng_state, for one, reads from a storage's start
        t = t.clone()
    return t.cpu() if spec.host else t


def _refuse(pg, src: int, code: int, device: torch.device, timeout: Optional[timedelta]) -> None:
    _wait(pg.send([torch.tensor([code], dtype=torch.int64, device=device)], src, _VERDICT), timeout,
          f"refused the heal header of rank {src}")


class HealTransport:
    """torchft's ``CheckpointTransport`` (``metadata``, ``send_checkpoint``, ``recv_checkpoint``,
    ``disallow_checkpoint``, ``shutdown``) over :func:`send` and :func:`receive` on ``pg``, the Manager's own
    cross-group process group (which it reconfigures every quorum; this object keeps the reference). The Manager
    only calls these methods, so no torchft import is needed. ``layout`` is this rank's (heal.layout_of): a payload
    of another layout, or whose tree is not torchft's (wire_checks.manager_tree_problem; ``user_keys`` the keys the
    group registers), is refused before any tensor byte moves."""

    def __init__(self, pg, *, layout: Any, device: torch.device = torch.device("cpu"), max_bytes: Optional[int] = None,
                 max_tensors: Optional[int] = None, user_keys: Optional[Sequence[str]] = None) -> None:
        self.pg, self.layout, self.device, self.max_bytes = pg, layout, torch.device(device), max_bytes
        self.max_tensors, self.user_keys = max_tensors, user_keys
        self.bytes_sent = self.bytes_received = 0

    def metadata(self) -> str:
        return FORMAT

    def send_checkpoint(self, dst_ranks: Sequence[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        header, tensors = encode(state_dict, step=step, layout=self.layout)
        refused = []
        for dst in dst_ranks:  # one receiver's refusal does not starve the others
            try:
                self.bytes_sent += send(self.pg, dst, header, tensors, device=self.device, timeout=timeout)
            except PayloadError as err:
                refused.append(err)
        if refused:
            raise refused[0]

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        if metadata != FORMAT:
            raise PayloadError(_hint(f"the sending group offers heal payloads of format {metadata!r:.80}; this group"
                                     f" reads {FORMAT!r}"))
        def check(header: Header) -> None:
            problem = manager_tree_problem(header.tree, step, self.user_keys, MAX_COUNT)
            if problem is not None:
                raise PayloadError(_hint(f"heal payload from rank {src_rank}: {problem}"))

        tree, received = receive(self.pg, src_rank, step=step, layout=self.layout, device=self.device,
                                 timeout=timeout, max_bytes=self.max_bytes, max_tensors=self.max_tensors, check=check)
        self.bytes_received += received
        return tree

    def disallow_checkpoint(self) -> None:
        """Nothing to stop: :meth:`send_checkpoint` returns only when every byte has gone."""

    def shutdown(self, wait: bool = True) -> None:
        """Nothing runs in the background."""
