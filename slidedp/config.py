"""The job file: job.toml -> nested frozen dataclasses, one per section (torchtitan style).

Each section validates itself in `__post_init__` and names the offending `section.key`, the
bad value and what is allowed (slidedp/section.py: the checks they share). Unknown sections and
keys are rejected, never ignored: a typo in a job file must not silently train with a default.
Relative paths are resolved against the job file's directory, so a job file works from any
current directory. The [plan] section, the step plan's choices, is slidedp/plan_section.py; keys
of older versions are moved to their current names by slidedp/old_names.py.
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from slidedp import old_names
from slidedp.model.config import NAMED_SHAPES, named_shape
from slidedp.paths import check_store_name
from slidedp.plan_section import PlanSection
from slidedp.section import ConfigError, Section, show

if TYPE_CHECKING:
    from slidedp.model.config import ModelConfig


@dataclass(frozen=True)
class ModelSection(Section):
    _name: ClassVar[str] = "model"
    _paths: ClassVar[tuple[str, ...]] = ("path",)
    source: str = "random"  # "random": a named shape, randomly initialised; "hf": a Hugging Face folder
    path: str = ""
    shape: str = "tiny"
    vocab_size: int = 0  # 0 = the shape's own; lets a random model match a tokenizer
    init_seed: int = 0

    def validate(self) -> None:
        self._choice("source", ("random", "hf"))
        self._range("vocab_size", 0)
        self._range("init_seed", 0)
        if self.source == "random":
            self._choice("shape", tuple(NAMED_SHAPES))
        else:
            if not self.path:
                raise ConfigError("model.path is required when model.source = 'hf' (a Hugging Face checkpoint folder)")
            folder = self._existing("path", "model folder")
            if not (folder / "config.json").is_file():
                raise ConfigError(f"model.path: {str(folder)!r} has no config.json; is it a Hugging Face checkpoint folder?")
            if self.vocab_size:
                raise ConfigError(
                    f"model.vocab_size applies to source = 'random' only; got {self.vocab_size} with source = 'hf' "
                    "(the checkpoint's config.json sets the vocabulary)"
                )


DATA_FORMATS = ("jsonl", "parquet", "arrow", "npy", "bin")
TOKEN_DTYPES = ("uint16", "uint32", "int32", "int64")


@dataclass(frozen=True)
class DataSection(Section):
    _name: ClassVar[str] = "data"
    _paths: ClassVar[tuple[str, ...]] = ("path", "tokenizer", "chat_template", "eval_path")
    _lists: ClassVar[tuple[str, ...]] = ("path", "eval_path")
    path: str  # a file, a folder, or a list of them
    format: str = "jsonl"
    tokenizer: str = ""  # a Hugging Face tokenizer.json; "" = the model folder's
    text_key: str = "text"
    dtype: str = "uint16"  # element type of a raw .bin token file
    shuffle: bool = False
    seed: int = 0
    kind: str = "auto"  # what a record holds: text, chat (messages), prompt_completion; auto: the first record says
    packing: str = "auto"  # stream (raw text windows), packed (documents), padded (one per row); auto: by kind
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    completion_key: str = "completion"
    train_on_prompt: bool = False  # false: the loss is on assistant / completion tokens only
    overlong: str = "truncate"  # a document longer than seq_len + 1 tokens: "truncate" or "drop"
    chat_template: str = ""  # a Jinja file replacing the tokenizer's chat template
    eval_path: str = ""  # held-out data, read like path; "" = no eval

    def validate(self) -> None:
        self._choice("format", DATA_FORMATS)
        self._choice("dtype", TOKEN_DTYPES)
        self._choice("kind", ("auto", "text", "chat", "prompt_completion"))
        self._choice("packing", ("auto", "stream", "packed", "padded"))
        self._choice("overlong", ("truncate", "drop"))
        self._range("seed", 0)
        if not self.path:
            raise ConfigError("data.path must name a data file; got ''")
        self._existing("path", "data file")
        if self.tokenizer:
            self._existing("tokenizer", "tokenizer file")
        if self.chat_template:
            self._existing("chat_template", "chat template file")
        if self.eval_path:
            self._existing("eval_path", "eval data file")
        for key in ("text_key", "messages_key", "prompt_key", "completion_key"):
            if not getattr(self, key):
                raise ConfigError(f"data.{key} must not be empty")
        if self.format in ("npy", "bin") and (self.kind not in ("auto", "text") or self.packing not in ("auto", "stream")):
            raise ConfigError(f"data.format = {self.format!r} holds token ids, not documents: data.kind must be "
                              f"'auto' or 'text' and data.packing 'auto' or 'stream'")
        if self.format in ("npy", "bin") and (len(self.paths) != 1 or Path(self.paths[0]).is_dir()):
            given = f"a list of {len(self.paths)}" if len(self.paths) != 1 else f"the folder {self.paths[0]!r}"
            raise ConfigError(f"data.format = {self.format!r} reads one file of token ids; data.path is {given}: "
                              "join the ids into one file (numpy.concatenate), or use jsonl, parquet or arrow")

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.path,) if isinstance(self.path, str) else tuple(self.path)

    @property
    def paths_of_eval(self) -> tuple[str, ...]:
        return () if not self.eval_path else (self.eval_path,) if isinstance(self.eval_path, str) else \
            tuple(self.eval_path)


@dataclass(frozen=True)
class TrainSection(Section):
    _name: ClassVar[str] = "train"
    steps: int
    global_batch: int  # sequences per optimizer step, over all ranks (plan.micro_batch: how many per pass)
    seq_len: int
    lr: float
    min_lr_ratio: float = 0.1
    warmup_steps: int = 0
    schedule: str = "cosine"
    schedule_start: int = 0  # the step the LR schedule (warmup, decay) starts at: a new schedule on a trained store
    schedule_steps: int = 0  # the step it ends at (0 = train.steps): an old train.steps continues the old schedule
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0  # 0 disables clipping
    seed: int = 0
    compile: str = "auto"  # the layers' pointwise kernels through torch.compile: auto (on CUDA), on, off
    eval_every: int = 0  # steps between eval losses over data.eval_path (and one at the end); 0 = none
    router_aux_loss: str = "auto"  # MoE routers' load-balancing loss: auto (config.json's output_router_logits), on, off

    def validate(self) -> None:
        for name in ("steps", "global_batch", "seq_len"):
            self._range(name, 1)
        self._range("lr", 0, lo_open=True)
        self._range("min_lr_ratio", 0, 1)
        self._range("warmup_steps", 0)
        self._choice("schedule", ("cosine", "constant", "linear"))
        self._range("schedule_start", 0)
        self._range("schedule_steps", 0)
        end = self.schedule_steps or self.steps
        if not self.__dict__.get("_problems") and self.schedule_start >= end:  # only from keys that are valid
            self._report(f"train.schedule_start ({self.schedule_start}) must be below the schedule's end "
                         f"(train.schedule_steps, else train.steps: {end})")
        self._range("weight_decay", 0)
        self._range("beta1", 0, 1, hi_open=True)
        self._range("beta2", 0, 1, hi_open=True)
        self._range("eps", 0, lo_open=True)
        self._range("max_grad_norm", 0)
        self._range("seed", 0)
        self._choice("compile", ("auto", "on", "off"))
        self._range("eval_every", 0)
        self._choice("router_aux_loss", ("auto", "on", "off"))

    def adds_router_aux(self, source: dict) -> bool:
        """Whether the job adds an MoE model's router auxiliary loss: router_aux_loss "on", "off", or "auto" (as
        the model's config.json says: output_router_logits; source: that config, model.config.source())."""
        if self.router_aux_loss == "auto":
            return bool(source.get("output_router_logits"))
        return self.router_aux_loss == "on"


@dataclass(frozen=True)
class MemorySection(Section):
    _name: ClassVar[str] = "memory"
    device_budget_gib: float = 24.0  # GPU memory per rank the plan may take (the plan's choices: [plan])

    def validate(self) -> None:
        self._range("device_budget_gib", 0, lo_open=True)


@dataclass(frozen=True)
class StoreSection(Section):
    _name: ClassVar[str] = "store"
    name: str = ""  # "" = the run name
    persist: bool = False  # false: destroyed when the job that created it ends
    # a bf16 copy of the weights beside the master (2 B/param more host memory), refreshed by the updater,
    # which the bf16 delivery streams instead of the fp32 master: true, false, or "auto": a store this job
    # creates has one when its plan delivers bf16 (docs/job-file.md says when). An existing store keeps its own.
    shadow_bf16: bool | str = "auto"
    grad_slots: int = 0  # per rank; 0 = auto (a third of the layers, 3..16: room for the updaters' backlog)

    def validate(self) -> None:
        if self.shadow_bf16 not in (True, False, "auto"):
            self._report(f"store.shadow_bf16 must be true, false or \"auto\"; got {show(self.shadow_bf16)}")
        if self.grad_slots == 1 or self.grad_slots < 0:
            raise ConfigError(f"store.grad_slots must be 0 (auto) or at least 2, got {self.grad_slots}")
        if self.name:
            _check_name("store.name", self.name)


@dataclass(frozen=True)
class CheckpointSection(Section):
    _name: ClassVar[str] = "checkpoint"
    _paths: ClassVar[tuple[str, ...]] = ("dir", "resume")
    dir: str = ""  # "" = <run dir>/checkpoints
    every: int = 0  # steps; 0 = only at the end
    keep: int = 3
    final: bool = True
    dtype: str = "bf16"
    resume: str = ""  # "" | "latest" | a checkpoint path

    def validate(self) -> None:
        self._range("every", 0)
        self._range("keep", 1)
        self._choice("dtype", ("bf16", "fp32"))
        if self.resume not in ("", "latest"):
            self._existing("resume", "checkpoint")


@dataclass(frozen=True)
class RunSection(Section):
    _name: ClassVar[str] = "run"
    _paths: ClassVar[tuple[str, ...]] = ("dir",)
    name: str = ""  # default: the job file's stem
    dir: str = ""  # "" = runs/<name> under the current directory
    log_every: int = 1
    trace_steps: str = ""  # steps to record in trace.json, e.g. "5" or "5,6" ("" = none)
    overwrite: bool = False  # a run dir holding another run: replace it (else the job is refused; launch/rundir.py)
    tensorboard: bool = False  # also write TensorBoard event files under <run dir>/tensorboard

    def validate(self) -> None:
        self._range("log_every", 1)
        try:
            steps = self.traced
        except ValueError:
            steps = (-1,)
        if any(s < 0 for s in steps):
            raise ConfigError(f"run.trace_steps must be comma-separated step numbers >= 0 (e.g. \"5,6\"), "
                              f"got {self.trace_steps!r}")
        if self.name:
            _check_name("run.name (default: the job file's stem; it also names the store)", self.name)

    @property
    def traced(self) -> tuple[int, ...]:
        return tuple(int(x) for x in self.trace_steps.split(",") if x.strip())


@dataclass(frozen=True)
class RuntimeSection(Section):
    _name: ClassVar[str] = "runtime"
    device: str = "cpu"
    workers: int = 1  # ranks
    updaters: int = 0  # 0 = one per NUMA node
    updater_threads: int = 0  # 0 = the cores of the node
    timeout_s: float = 120.0
    nnodes: int = 1  # hosts in the job (docs/multi-host.md); each runs `workers` ranks and its own store
    node_rank: int = 0  # this host's place among them (0: serves the rendezvous)
    master_addr: str = ""  # host 0's address every host reaches it by (needed with nnodes > 1)
    master_port: int = 29500  # the rendezvous' port on host 0; the ranks' process group meets on the next one
    # the network between hosts, for the plan (docs/multi-host.md, "The step model"): Gb/s each way per host and
    # the latency of one step of a ring; 0 = what runs on several hosts measured on this host, else the planner's
    # assumption (100 Gb/s, 20 us)
    network_gbps: float = 0.0
    network_latency_us: float = 0.0

    def validate(self) -> None:
        self._choice("device", ("cpu", "cuda"))
        self._range("workers", 1)
        self._range("updaters", 0)
        self._range("updater_threads", 0)
        self._range("timeout_s", 0, lo_open=True)
        self._range("nnodes", 1)
        self._range("node_rank", 0)
        self._range("master_port", 1, 65534)
        self._range("network_gbps", 0)
        self._range("network_latency_us", 0)
        if not self.__dict__.get("_problems"):
            if self.node_rank >= self.nnodes:
                self._report(f"runtime.node_rank ({self.node_rank}) must be below runtime.nnodes ({self.nnodes})")
            if self.nnodes > 1 and not self.master_addr:
                self._report("runtime.master_addr is needed with several hosts (runtime.nnodes > 1): host 0's "
                             "address (--master-addr)")

    @property
    def world(self) -> int:
        """Ranks over every host."""
        return self.nnodes * self.workers

    def global_rank(self, local: int) -> int:
        return self.node_rank * self.workers + local


def _check_name(key: str, name: str) -> None:
    try:
        check_store_name(name)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


SECTIONS: dict[str, type[Section]] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "plan": PlanSection,
    "memory": MemorySection,
    "store": StoreSection,
    "checkpoint": CheckpointSection,
    "run": RunSection,
    "runtime": RuntimeSection,
}


@dataclass(frozen=True)
class JobConfig:
    model: ModelSection
    data: DataSection
    train: TrainSection
    plan: PlanSection = field(default_factory=PlanSection)
    memory: MemorySection = field(default_factory=MemorySection)
    store: StoreSection = field(default_factory=StoreSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    run: RunSection = field(default_factory=RunSection)
    runtime: RuntimeSection = field(default_factory=RuntimeSection)

    def __post_init__(self) -> None:
        t, w, mb = self.train, self.runtime.world, self.plan.chosen("micro_batch")
        ranks = (f"runtime.workers ({w})" if self.runtime.nnodes == 1 else
                 f"the ranks of every host (runtime.nnodes x runtime.workers = {w})")
        if mb is None and t.global_batch % w:
            raise ConfigError(
                f"train.global_batch ({t.global_batch}) must be divisible by {ranks}: every rank "
                f"runs the same number of sequences (plan.micro_batch = \"auto\" lets the plan split them into passes)"
            )
        if mb is not None and t.global_batch % mb:
            raise ConfigError(f"plan.micro_batch ({mb}) must divide train.global_batch ({t.global_batch})")
        if mb is not None and t.global_batch % (w * mb):
            raise ConfigError(
                f"train.global_batch ({t.global_batch}) must be divisible by {ranks} x "
                f"plan.micro_batch ({mb}) = {w * mb}"
            )
        if not self.run.name:
            raise ConfigError("run.name is empty; set it, or load the job from a file whose stem names the run")
        d, m = self.data, self.model
        if d.format not in ("npy", "bin") and not d.tokenizer and not (
                m.source == "hf" and (Path(m.path) / "tokenizer.json").is_file()):
            raise ConfigError(f"data.tokenizer is required when data.format = {d.format!r} (path to a tokenizer.json)"
                              + (f", as {m.path} has no tokenizer.json" if m.source == "hf" else ""))
        if self.train.eval_every and not d.eval_path:
            raise ConfigError("train.eval_every needs data.eval_path (the held-out data)")
        if self.plan.delivery == "bf16" and self.plan.dtype != "bf16":
            raise ConfigError(f"plan.delivery = \"bf16\" streams the weights rounded to bf16: it needs "
                              f"plan.compute_dtype = \"bf16\" or \"auto\" (got {self.plan.compute_dtype!r}); set "
                              f"plan.delivery = \"fp32\" or \"auto\"")
        if self.plan.delivery == "bf16" and self.store.shadow_bf16 is False:
            raise ConfigError("plan.delivery = \"bf16\" streams the store's bf16 shadow, and store.shadow_bf16 = "
                              "false makes a store without one: set store.shadow_bf16 = true or \"auto\"")

    @property
    def store_name(self) -> str:
        return self.store.name or self.run.name

    @property
    def run_dir(self) -> Path:
        return Path(self.run.dir) if self.run.dir else Path.cwd() / "runs" / self.run.name

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpoint.dir) if self.checkpoint.dir else self.run_dir / "checkpoints"


# ---- reading ---------------------------------------------------------------------------------


def load_job(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Read a job file; `overrides` are "section.key=value" (value parsed as TOML, else a string).

    Relative paths in the file resolve against the file's directory; relative paths in
    overrides (typed on a command line) against the current directory.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"job file {str(path)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"job file {str(path)!r} cannot be read: {e}") from None
    try:
        d = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: malformed TOML: {e}") from None
    problems: list[str] = []
    for item in overrides:
        try:
            _apply_override(d, item)
        except ConfigError as e:
            problems.extend(e.problems)
    try:
        job = job_from_dict(d, path.resolve().parent, path.stem)
    except ConfigError as e:
        problems.extend(f"{path}: {p}" for p in e.problems)
    if problems:
        raise ConfigError(problems=problems)
    return job


def _apply_override(d: dict[str, Any], item: str) -> None:
    key, eq, raw = item.partition("=")
    section, dot, name = key.strip().partition(".")
    if not eq or not dot or not section or not name or "." in name:
        raise ConfigError(f"bad override {item!r}: expected section.key=value, e.g. train.steps=100")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()  # not a TOML value: take it as a plain string (paths, names)
    section, name, value = old_names.override_key(d, f"{section}.{name}", value)
    table = d.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"bad override {item!r}: {section!r} is not a section")
    cls = SECTIONS.get(section)
    if cls and name in cls._paths and isinstance(value, str) and value and (section, name, value) != (
        "checkpoint", "resume", "latest"
    ):
        value = str(Path(value).expanduser().absolute())  # typed on a command line: relative to the cwd
    elif cls and name in cls._lists and isinstance(value, list):
        value = [str(Path(v).expanduser().absolute()) if isinstance(v, str) and v else v for v in value]
    table[name] = value


def job_from_dict(d: dict[str, Any], base_dir: Path, name_hint: str) -> JobConfig:
    """Build a JobConfig from parsed TOML; relative paths resolve against `base_dir`."""
    problems: list[str] = []  # every one, not the first: a job file is fixed in one go
    d = {name: dict(table) if isinstance(table, dict) else table for name, table in d.items()}
    problems += old_names.move_job_keys(d)
    for name, table in d.items():
        if name not in SECTIONS:
            what = f"section [{name}]" if isinstance(table, dict) else f"top-level key {name!r}"
            problems.append(f"unknown {what}; allowed sections: {', '.join(SECTIONS)}")
        elif not isinstance(table, dict):
            problems.append(f"[{name}] must be a section (a table), got {show(table)}")
    sections: dict[str, Section] = {}
    for name, cls in SECTIONS.items():
        values = d.get(name, {})
        values = dict(values) if isinstance(values, dict) else {}
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        bad = [f"unknown key {name}.{key}; allowed keys in [{name}]: {', '.join(fields)}"
               for key in values if key not in fields]
        bad += [f"{name}.{key} is required" for key, f in fields.items()
                if key not in values and f.default is dataclasses.MISSING]
        if bad:
            problems.extend(bad)
            continue
        if name == "run":
            values.setdefault("name", name_hint)
        for key in cls._paths:
            v = values.get(key)
            if isinstance(v, str) and v and not (name == "checkpoint" and key == "resume" and v == "latest"):
                values[key] = str((Path(base_dir) / Path(v).expanduser()).resolve())
            elif isinstance(v, list) and key in cls._lists:
                values[key] = [str((Path(base_dir) / Path(x).expanduser()).resolve()) if isinstance(x, str) and x
                               else x for x in v]
        if name == "run" and not values.get("dir") and isinstance(values.get("name"), str) and values["name"]:
            # Fix the run directory at load time so later chdirs and a saved copy agree.
            values["dir"] = str(Path.cwd() / "runs" / values["name"])
        try:
            sections[name] = cls(**values)
        except ConfigError as e:
            problems.extend(e.problems)
    if problems:
        raise ConfigError(problems=problems)
    return JobConfig(**sections)  # type: ignore[arg-type]


# ---- writing ---------------------------------------------------------------------------------


def job_to_dict(job: JobConfig) -> dict[str, dict[str, Any]]:
    return {name: dataclasses.asdict(getattr(job, name)) for name in SECTIONS}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # repr of a finite float is valid TOML (1e-08, 3.0)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, str):
        # JSON's escapes (\" \\ \n \uXXXX) are TOML basic-string escapes; TOML also wants DEL escaped.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def job_to_toml(job: JobConfig) -> str:
    """The resolved job as TOML; `load_job` on it gives back an equal JobConfig."""
    lines: list[str] = []
    for name, table in job_to_dict(job).items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    return "\n".join(lines)


def model_config(job: JobConfig) -> "ModelConfig":
    """The model shape: a named shape (vocab overridden) for "random", config.json for "hf"."""
    if job.model.source == "random":
        return named_shape(job.model.shape, job.model.vocab_size or None)
    from slidedp.model import hf_folder  # lazy: the folder's file handling (no torch: the launcher reads it)

    return hf_folder.read_config(job.model.path)
