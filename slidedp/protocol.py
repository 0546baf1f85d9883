"""Every message SlideDP's processes exchange: one frozen dataclass each, a fixed binary encoding.

Encoding: one type byte, then the fields packed with `struct` (little-endian); a message
whose last field is `text` carries a length-prefixed UTF-8 string (JSON for control
requests, prose for errors), one whose last field is `values` a length-prefixed array of
float64 (a few hundred statistics, such as the routers' expert counts). Messages carry
descriptors (chunk, step, rank, slot) and such small sums, never tensors, and never pickle. `decode` validates type, size and ranges; receivers drop what
fails it (`ProtocolError`) and log it, never crash on it.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import MISSING, asdict, astuple, dataclass, fields
from typing import ClassVar

MAX_TEXT = 1 << 20
MAX_VALUES = 1 << 16
_I32 = (-(2**31), 2**31 - 1)


class ProtocolError(ValueError):
    pass


_REGISTRY: dict[int, type["Message"]] = {}


class Message:
    TYPE: ClassVar[int]
    FORMAT: ClassVar[str]  # struct format of the fixed fields (after the type byte), without `text`
    _struct: ClassVar[struct.Struct]
    _has_text: ClassVar[bool]
    _has_values: ClassVar[bool]

    def encode(self) -> bytes:
        values = astuple(self)  # type: ignore[call-overload]
        if self._has_values:
            array = values[-1]
            if len(array) > MAX_VALUES:
                raise ProtocolError(f"{type(self).__name__} carries {len(array)} values, over {MAX_VALUES}")
            return (bytes([self.TYPE]) + self._struct.pack(*values[:-1]) + struct.pack("<I", len(array))
                    + struct.pack(f"<{len(array)}d", *array))
        if self._has_text:
            text = values[-1].encode()
            if len(text) > MAX_TEXT:
                raise ProtocolError(f"{type(self).__name__} text is {len(text)} bytes, over {MAX_TEXT}")
            return bytes([self.TYPE]) + self._struct.pack(*values[:-1]) + struct.pack("<I", len(text)) + text
        return bytes([self.TYPE]) + self._struct.pack(*values)

    def validate(self) -> None:
        """Range checks beyond what the struct format enforces; subclasses add theirs."""
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            if isinstance(v, float) and math.isnan(v) and f.name not in ("loss_sum", "sqnorm", "loss", "grad_norm"):
                raise ProtocolError(f"{type(self).__name__}.{f.name} is NaN")
            if isinstance(v, int) and f.name in ("rank", "chunk", "slot", "step", "version", "world") and v < 0:
                raise ProtocolError(f"{type(self).__name__}.{f.name} = {v} is negative")
            if f.name == "values" and not all(math.isfinite(x) for x in v):
                raise ProtocolError(f"{type(self).__name__}.values holds a value that is not finite")


def message(type_byte: int, fmt: str):
    def wrap(cls):
        cls = dataclass(frozen=True)(cls)
        names = [f.name for f in fields(cls)]
        cls.TYPE, cls.FORMAT = type_byte, fmt
        cls._has_text = bool(names) and names[-1] == "text"
        cls._has_values = bool(names) and names[-1] == "values"
        cls._struct = struct.Struct("<" + fmt)
        n_fixed = len(names) - cls._has_text - cls._has_values
        if len(cls._struct.unpack(bytes(cls._struct.size))) != n_fixed:
            raise TypeError(f"{cls.__name__}: format {fmt!r} does not match its {n_fixed} fixed fields")
        if type_byte in _REGISTRY:
            raise TypeError(f"message type {type_byte} used twice")
        _REGISTRY[type_byte] = cls
        return cls

    return wrap


def decode(data: bytes, expect: tuple[type[Message], ...] | None = None) -> Message:
    if not data:
        raise ProtocolError("empty message")
    cls = _REGISTRY.get(data[0])
    if cls is None:
        raise ProtocolError(f"unknown message type {data[0]}")
    if expect is not None and cls not in expect:
        raise ProtocolError(f"unexpected message {cls.__name__} here")
    body = data[1:]
    size = cls._struct.size
    if len(body) < size:
        raise ProtocolError(f"{cls.__name__} truncated: {len(body)} bytes, needs {size}")
    values = list(cls._struct.unpack_from(body, 0))
    rest = body[size:]
    if cls._has_values:
        if len(rest) < 4:
            raise ProtocolError(f"{cls.__name__} truncated: no count of values")
        (n,) = struct.unpack_from("<I", rest, 0)
        if n > MAX_VALUES or len(rest) != 4 + 8 * n:
            raise ProtocolError(f"{cls.__name__}: {n} values do not match the {len(rest) - 4} bytes present")
        values.append(struct.unpack_from(f"<{n}d", rest, 4))
    elif cls._has_text:
        if len(rest) < 4:
            raise ProtocolError(f"{cls.__name__} truncated: no text length")
        (n,) = struct.unpack_from("<I", rest, 0)
        if n > MAX_TEXT or len(rest) != 4 + n:
            raise ProtocolError(f"{cls.__name__} text length {n} does not match the {len(rest) - 4} bytes present")
        try:
            values.append(rest[4:].decode())
        except UnicodeDecodeError:
            raise ProtocolError(f"{cls.__name__} text is not UTF-8") from None
    elif rest:
        raise ProtocolError(f"{cls.__name__} has {len(rest)} trailing bytes")
    msg = cls(*values)
    msg.validate()
    return msg


# ---- data plane: workers, aggregator, updaters -----------------------------------------------
ROLE_WORKER, ROLE_UPDATER, ROLE_LAUNCHER = 1, 2, 3


@message(1, "Biii")
class Hello(Message):
    """First message of every peer that connects to a ROUTER: who it is."""
    role: int
    rank: int  # worker rank, updater index; 0 for the launcher
    size: int  # how many peers of this role there are (world size, updater pool size)
    pid: int


SLOT_DEVICE = 2**31 - 1  # Grad.slot of a chunk held on the device: only its norm travels


@message(2, "iiqid")
class Grad(Message):
    """Worker -> aggregator: chunk `chunk` of step `step` is in my gradient slot `slot`."""
    rank: int
    chunk: int
    step: int
    slot: int
    sqnorm: float  # squared L2 norm of this rank's chunk gradient (computed on the device)


@message(3, "iqdqB")
class Loss(Message):
    """Worker -> aggregator after its forward: its share of the summed token loss."""
    rank: int
    step: int
    loss_sum: float
    tokens: int
    finite: int


@message(4, "qBd")
class Go(Message):
    """Aggregator -> workers: every rank's loss is in; backward (skip=0) or skip the step (non-finite loss)."""
    step: int
    skip: int
    loss: float  # mean token loss of the global batch


@message(12, "iqd")
class Routing(Message):
    """Worker -> aggregator after its forward, before its Loss (a model whose routers add the auxiliary
    loss): its share of the routers' statistics (slidedp/model/router_aux.py: rows, each expert's top-k
    selections, each expert's summed probability) and the loss's coefficient."""
    rank: int
    step: int
    coef: float
    values: tuple[float, ...]


@message(22, "q")
class RoutingTotal(Message):
    """Aggregator -> workers, before the step's Go: the routers' statistics summed over every rank."""
    step: int
    values: tuple[float, ...]


@message(19, "qd")
class GlobalNorm(Message):
    """Worker (local rank 0) -> aggregator, several hosts: the step's squared gradient norm summed over every
    rank of every host (the aggregator's own sum covers its host's shards only)."""
    step: int
    sqnorm: float


@message(5, "ii")
class Credit(Message):
    """Aggregator -> worker: gradient slot `slot` of `rank` is free again."""
    rank: int
    slot: int


@message(6, "iq")
class Ready(Message):
    """Aggregator -> workers: chunk `chunk` now holds the weights for step `version`."""
    chunk: int
    version: int


# Where an Update's gradient lies: one rank's slot (one rank), the aggregator's reduction space
# (a sum), nowhere (the step was skipped), or rank `rank`'s shard of the chunk in that rank's slot
# (reduce-scattered on the devices: the updater takes one Update per rank and reads every shard
# where it lies).
SOURCE_RANK_SLOT, SOURCE_REDUCE, SOURCE_NONE, SOURCE_RANK_SHARD = 0, 1, 2, 3


@message(7, "iqBiiB")
class Update(Message):
    """Aggregator -> updater: the summed gradient of `chunk` for `step` (or, for SOURCE_RANK_SHARD,
    rank `rank`'s shard of it) is in (source, rank, slot). speculative=1 (exact clipping): update it
    now, unclipped, and settle it when the step's Norm comes; 0: update it once the Norm is in."""
    chunk: int
    step: int
    source: int
    rank: int
    slot: int
    speculative: int = 0


@message(8, "qd")
class Norm(Message):
    """Aggregator -> updaters (and workers holding chunks): the step's global gradient norm, its verdict:
    waiting updates proceed (clipped if it clips), speculated ones settle; not finite: the step is skipped."""
    step: int
    grad_norm: float


CONTROL_CONTINUE, CONTROL_STOP = 0, 1


@message(9, "Bq")
class Control(Message):
    """Launcher -> workers: continue past the checkpoint after `step`, or stop after `step`."""
    kind: int
    step: int


@message(10, "iqBiiidBd")
class Updated(Message):
    """Updater -> aggregator: chunk updated (or skipped) for `step`; its gradient source is free."""
    chunk: int
    step: int
    source: int
    rank: int
    slot: int
    updater: int
    busy_s: float  # time spent on this chunk's AdamW (a speculated one's correction included)
    corrected: int = 0  # its speculative update was redone clipped (or undone: the step was skipped)
    correct_s: float = 0.0  # of busy_s, the correction's


@message(11, "qddBddBiidBq")
class StepDone(Message):
    """Aggregator -> launcher: every chunk of `step` is updated; the step is committed."""
    step: int
    loss: float
    grad_norm: float
    skipped: int
    update_s: float  # summed updater busy time of the step's chunks
    reduce_s: float  # aggregator busy time summing the step's gradients
    clipped: int = 0  # the global norm was over train.max_grad_norm: the update was clipped
    speculated: int = 0  # host chunks updated before the norm was known (exact clipping)
    corrected: int = 0  # of those, redone clipped (or undone: a non-finite gradient skipped the step)
    correct_s: float = 0.0  # updater busy time of those corrections
    speculate: int = 0  # the step was allowed to speculate (the last committed step did not clip: slidedp/clipping)
    host_bytes: int = 0  # host memory the updaters' AdamW (and shadow refresh) and the aggregator's sums moved


@message(13, "B")
class JobStart(Message):
    """Launcher -> aggregator -> updaters: a job begins; `text` is its JSON job record."""
    kind: int
    text: str


@message(14, "B")
class JobEnd(Message):
    """Launcher -> aggregator -> updaters: the job ends; close its rings."""
    kind: int
    text: str


@message(15, "B")
class Ack(Message):
    """Reply to a control message: ok=1, or ok=0 with the error in `text`."""
    ok: int
    text: str


@message(16, "Bi")
class Fault(Message):
    """Any process -> its coordinator: I failed; `text` says why."""
    role: int
    rank: int
    text: str


@message(17, "iqddddddqqqdqq")
class WorkerStats(Message):
    """Worker -> launcher after each step: where its time went."""
    rank: int
    step: int
    step_s: float
    forward_s: float
    backward_s: float
    wait_version_s: float  # blocked until a chunk reached the step's version (updates behind)
    wait_slot_s: float  # blocked for a free gradient slot (aggregator/updaters behind)
    wait_loss_s: float  # blocked on the other ranks' loss
    h2d_bytes: int
    device_peak_bytes: int  # the allocator's tensors at their peak
    device_reserved_peak_bytes: int  # what the caching allocator held at its peak (the budget caps this)
    write_back_s: float = 0.0  # inside step_s: device-held units written back to the store (a checkpoint, the end)
    d2h_bytes: int = 0  # gradients written into host memory (h2d_bytes: parameters read from it)
    # times the caching allocator reached the memory cap and freed its cached blocks to retry: each one
    # synchronizes the device, so no copy overlaps compute across it
    device_alloc_retries: int = 0


@message(18, "iqdq")
class EvalLoss(Message):
    """Worker -> launcher, before its WorkerStats of `step`: its share of the eval loss on the weights after `step`."""
    rank: int
    step: int
    loss_sum: float
    tokens: int


# ---- control plane: requests to the host-state daemon ------------------------------------------
# A request is one of the typed requests below, carried as Request(kind, its fields as a JSON
# object); the daemon answers Reply(ok, a JSON object, or the reason it refused).

GRAD_SLOTS = 3  # gradient slots per rank where the job names none (a job's store.grad_slots: jobrecord.ring_slots)
REDUCE_SLOTS = 3  # chunk-sized slots the aggregator sums several ranks' whole gradients into


@dataclass(frozen=True)
class Ping:
    """Is the daemon there: its pid, and whether the store exists."""


@dataclass(frozen=True)
class Create:
    """Create the store: from a named shape with random weights ("random") or a Hugging Face folder ("hf")."""
    source: str | None = None
    shape: str = "tiny"
    vocab_size: int | None = 0  # 0: the shape's
    init_seed: int = 0
    path: str = ""
    chunk_rows: int = 0  # 0: one decoder layer's parameters per embedding/head chunk
    layer_chunk_numel: int | None = None  # the most elements of a layer's chunk (None: the layout's rule; 0: whole layers)
    shadow_bf16: bool = False
    persist: bool = True  # False: a job's own store, destroyed when it ends (found left behind: its creator died)
    creator: dict | None = None  # with persist False: the creating job (pid, start time, name)
    part: dict | None = None  # several hosts: {"hosts", "host", "ranks"}, the host's part of the state (store/part.py)


@dataclass(frozen=True)
class Attach:
    """Attach a job (the launcher's pid): the store checked against its layout, its gradient rings made."""
    world: int
    pid: int
    job: str = ""
    layout_hash: str = ""
    model_desc: str = "?"
    grad_slots: int = GRAD_SLOTS
    reduce_slots: int = REDUCE_SLOTS
    full_reduce: bool = False  # one full-model reduction buffer (exact clipping) instead of reduce_slots
    shard_slots: bool = False  # slots sized for one rank's shard (the reduce_scatter route)
    shard_ranks: int = 0  # the ranks a chunk is cut among on that route (several hosts: all of them; 0: world)
    hyper: dict | None = None  # the job's [train] section, kept in the manifest's job record


@dataclass(frozen=True)
class Detach:
    """Detach the attached job (its token from Attach): its gradient rings go."""
    token: int = -1


@dataclass(frozen=True)
class Status:
    """The store's model, segments, committed step, torn state and attached job."""


@dataclass(frozen=True)
class Checkpoint:
    """Checkpoint the committed step into `dir`; background: written while training goes on."""
    dir: str
    dtype: str = "bf16"
    keep: int = 3
    extra: dict | None = None
    extra_files: list | None = None
    background: bool = False


@dataclass(frozen=True)
class CheckpointWait:
    """Wait until the checkpoint written in the background is complete: its path, or its error."""


@dataclass(frozen=True)
class Restore:
    """Load a checkpoint into the store."""
    path: str
    token: int = -1  # the attached job's, which may restore while attached
    unless_held: bool = False  # a job's resume: always verified, restored unless the store holds it byte for byte


@dataclass(frozen=True)
class Destroy:
    """Remove the store's segments (its state is lost); force: even with a job attached."""
    force: bool = False


@dataclass(frozen=True)
class Shutdown:
    """Stop the daemon; the store stays in place."""


ControlRequest = Ping | Create | Attach | Detach | Status | Checkpoint | CheckpointWait | Restore | Destroy | Shutdown
CONTROL: dict[str, type] = {"ping": Ping, "create": Create, "attach": Attach, "detach": Detach, "status": Status,
                            "checkpoint": Checkpoint, "restore": Restore, "destroy": Destroy, "shutdown": Shutdown,
                            "checkpoint_wait": CheckpointWait}
REQUESTS = tuple(CONTROL)  # Request.kind indexes this: the order is the wire's
KIND_OF = {cls: kind for kind, cls in CONTROL.items()}


class ControlError(ValueError):
    """A request whose arguments do not make one of the typed requests: the text says which."""


def control(kind: str, **args: object) -> ControlRequest:
    """The typed request `kind` with `args`; ControlError names an unknown kind, or a missing or unknown argument."""
    cls = CONTROL.get(kind)
    if cls is None:
        raise ControlError(f"unknown request {kind!r}")
    names = [f.name for f in fields(cls)]
    unknown = sorted(set(args) - set(names))
    if unknown:
        raise ControlError(f"{kind}: unknown argument(s) {', '.join(map(repr, unknown))}")
    missing = [f.name for f in fields(cls) if f.name not in args and f.default is MISSING]
    if missing:
        raise ControlError(f"missing argument {missing[0]!r}")
    return cls(**args)


def encode_control(req: ControlRequest) -> Request:
    return Request(REQUESTS.index(KIND_OF[type(req)]), json.dumps(asdict(req)))


def decode_control(req: "Request") -> ControlRequest:
    """The typed request a Request carries (its JSON object of arguments checked against the type)."""
    args = json.loads(req.text or "{}")
    if not isinstance(args, dict):
        raise ControlError("request arguments must be a JSON object")
    return control(req.name, **args)


@message(20, "B")
class Request(Message):
    """Client -> host-state daemon: `kind` indexes REQUESTS; `text` is a JSON object of the typed request's fields."""
    kind: int
    text: str

    def validate(self) -> None:
        if self.kind >= len(REQUESTS):
            raise ProtocolError(f"Request kind {self.kind} unknown (0..{len(REQUESTS) - 1})")

    @property
    def name(self) -> str:
        return REQUESTS[self.kind]


@message(21, "B")
class Reply(Message):
    """Host-state daemon -> client: ok=1 with a JSON result, or ok=0 with the error text."""
    ok: int
    text: str


def request(name: str, text: str = "{}") -> Request:
    """A raw Request (tests send malformed ones); clients send typed requests with encode_control."""
    return Request(REQUESTS.index(name), text)
