"""One settings dataclass, one precedence rule: defaults < YAML file < ``SMARTCKPT_*`` env < flags.

``load_settings`` also records where each value came from (for ``smartckpt config show``).
Unknown keys and wrong types are errors naming the key, wherever they come from.
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from smartckpt_cli.errors import ConfigError
from smartckpt_cli.state.tiers import PRECISIONS, TierRule, parse_rules

__all__ = [
    "CONFIG_FILE",
    "ENV_PREFIX",
    "Settings",
    "load_settings",
    "parse_every",
    "parse_size",
    "public_settings",
]

CONFIG_FILE = "smartckpt.yaml"
ENV_PREFIX = "SMARTCKPT_"


@dataclass(frozen=True)
class Settings:
    dir: str = "checkpoints"
    meta_dir: str | None = None
    keep_last: int = 3
    precision: str = "exact"  # exact | bf16 | fp16 (optimizer moments only)
    compression_level: int = 1  # zstd level; -1 stores raw
    chunk_mb: int = 16
    # A tensor unchanged since the last checkpoint (a frozen weight) is referenced, not copied;
    # every such tensor is copied and hashed again within this many saves (engine/unchanged.py).
    reverify_saves: int = 8
    workers: int = 0  # encoder threads; 0 = min(8, 2 x CPUs)
    background_nice: int = 10  # CPU priority of the background threads (Linux nice, 0 = off)
    on_l2_corrupt: str = "fallback"  # fallback | reset
    policy: str = "adaptive"  # adaptive | seed | fixed (see trigger.py)
    every_steps: int | None = None  # a fixed schedule; overrides the policy
    every_seconds: float | None = None
    every: str | None = None  # "50" (steps) or "30s"/"5m" (duration): sets one of the two above
    max_interval: float = 180.0  # seconds of training that may go unsaved
    max_interval_steps: int | None = None
    min_interval: float = 10.0  # seconds: the floor between a policy's own saves
    threshold: float = 0.65  # the seed policy's score threshold
    mtbf: float = 21600.0  # seconds between failures, for the Young/Daly interval
    alarm_z: float = 6.0  # adaptive policy: robust z-score of a precursor that saves at once (inf: never)
    memory_high: float = 0.9  # fraction of the memory ceiling that saves at a new high (0: memory signal off)
    eval_every: int | None = None  # steps between signal evaluations; None: 10, more when steps are short
    loss_window: int = 5  # losses in the median filter
    preempt_signals: str = "TERM,INT,USR1,USR2"  # take a blocking save at the next step, then...
    usr_continue: bool = False  # ...exit (TERM always), or go on training after USR1/USR2
    inflight: str = "wait"  # wait | skip: what a trigger does while a save is running
    distributed: str = "auto"  # auto: coordinate ranks when torch.distributed runs | off
    rank_timeout: float = 900.0  # seconds a rank waits for the others in smartckpt's collectives
    tiers: tuple[TierRule, ...] = field(default_factory=tuple)
    # smartckpt run (the supervisor)
    max_restarts: int = 5  # restarts after failures before giving up
    hang_timeout: float | None = None  # seconds without a step; None = learned from step times
    first_step_timeout: float = 1800.0  # seconds from a start to its first step (imports, data, restore)
    requeue: bool = False  # after a preemption signal (USR1/USR2): scontrol requeue the SLURM job
    grace_period: float = 30.0  # seconds the child gets to save and exit after SIGTERM/SIGINT
    restart_backoff: float = 2.0  # before restarting an attempt that got nowhere; doubles per one in a row
    crash_loop: int = 3  # failed attempts from the same checkpoint before rolling back once
    no_restart_on: str = ""  # regexes (separated by ';;') for errors that must not be restarted
    log_every: float = 30.0  # seconds between status lines when the output is not a terminal
    # the remote tier (smartckpt_cli/remote): committed checkpoints replicated in the background
    remote: str | None = None  # s3://bucket/prefix, gs://..., file:///mnt/nfs/ckpt; None = off
    remote_keep_last: int = 0  # checkpoints kept remotely; 0 = keep_last
    remote_workers: int = 4  # concurrent uploads (and downloads on restore)
    remote_bandwidth_mb: float = 0.0  # upload cap in MiB/s; 0 = unlimited
    remote_part_mb: int = 64  # multipart part size for large blobs (S3's minimum is 5)
    remote_retries: int = 4  # tries of each remote call before the round is retried later
    remote_close_wait: float = 120.0  # seconds close()/preemption wait for uploads
    # nothing to resume locally and the remote unreachable at start: wait this long for it, then
    # refuse to start (never a silent start over at step 0)...
    remote_start_wait: float = 300.0
    remote_start_fresh: bool = False  # ...unless asked to start a new store at step 0 at once
    # the RAM tier (smartckpt run): the newest snapshot in shared memory that outlives the process
    ram: bool = True  # off: staging in private memory, restarts restore from disk
    ram_every: float | None = None  # seconds between RAM snapshots; None: as often as RAM_SHARE allows
    ram_budget: str | None = None  # per rank: "8G", "512M", bytes; None: half the free memory / local ranks
    ram_dir: str | None = None  # where the RAM tier lives (a tmpfs); None: /dev/shm
    # 1: one copy of the state in shared memory, the staging buffer itself (a crash during a
    # snapshot's copy restores from disk); 2: the previous RAM snapshot stays whole while the
    # next is copied, for a second copy of the state's size per rank; 0: 2 when memory_budget
    # has room for two copies, else 1
    ram_slots: int = 0
    # per rank: the most host memory a save holds beyond training (staging, RAM slots, encoder
    # scratch): "16G", bytes; None: one copy of the state. Below one copy, saves go in pieces
    # (engine/budget.py).
    memory_budget: str | None = None
    # a spare interpreter, torch imported, waits to become the next attempt (supervise/warm.py)
    warm_restart: bool = True

    def __post_init__(self) -> None:
        # One check per group of settings, in the order of the groups (the first error is raised).
        self._check_saving()
        self._check_trigger()
        self._check_supervisor()
        self._check_remote()
        self._check_ram()
        self._check_lists()

    def _check_saving(self) -> None:
        """Where and how a checkpoint is written and restored."""
        if self.keep_last < 1:
            raise ConfigError("keep_last must be at least 1")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.on_l2_corrupt not in ("fallback", "reset"):
            raise ConfigError(f"on_l2_corrupt must be 'fallback' or 'reset', not {self.on_l2_corrupt!r}")
        if self.inflight not in ("wait", "skip"):
            raise ConfigError(f"inflight must be 'wait' or 'skip', not {self.inflight!r}")
        if self.distributed not in ("auto", "off"):
            raise ConfigError(f"distributed must be 'auto' or 'off', not {self.distributed!r}")
        if self.rank_timeout <= 0:
            raise ConfigError("rank_timeout must be positive (seconds)")
        if not -1 <= self.compression_level <= 22:
            raise ConfigError("compression_level must be between -1 (raw) and 22")
        if self.chunk_mb < 1:
            raise ConfigError("chunk_mb must be at least 1")
        if self.reverify_saves < 1:
            raise ConfigError("reverify_saves must be at least 1")

    def _check_trigger(self) -> None:
        """When to save: the policy, its intervals and signals, a fixed schedule (``every`` sets
        ``every_steps`` or ``every_seconds``)."""
        if self.max_interval <= 0:
            raise ConfigError("max_interval must be positive")
        if self.policy not in ("adaptive", "seed", "fixed"):
            raise ConfigError(f"policy must be adaptive, seed or fixed, not {self.policy!r}")
        if self.min_interval < 0 or self.min_interval > self.max_interval:
            raise ConfigError("min_interval must be between 0 and max_interval")
        if (self.eval_every is not None and self.eval_every < 1) or self.loss_window < 1:
            raise ConfigError("eval_every and loss_window must be at least 1")
        if self.mtbf <= 0:
            raise ConfigError("mtbf must be positive")
        if not self.alarm_z > 0:
            raise ConfigError("alarm_z must be positive (inf turns precursor saves off)")
        if not 0.0 <= self.memory_high <= 1.0:
            raise ConfigError("memory_high must be between 0 (off) and 1")
        if self.every is not None:
            try:
                steps, seconds = parse_every(self.every)
            except ValueError as err:
                raise ConfigError(f"every: {err}") from None
            object.__setattr__(self, "every_steps", steps)
            object.__setattr__(self, "every_seconds", seconds)

    def _check_supervisor(self) -> None:
        """``smartckpt run``'s restarts and timeouts."""
        if self.max_restarts < 0:
            raise ConfigError("max_restarts must be 0 or more")
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise ConfigError("hang_timeout must be positive (seconds)")
        if not self.first_step_timeout > 0:
            raise ConfigError("first_step_timeout must be positive (seconds)")
        if self.grace_period <= 0:
            raise ConfigError("grace_period must be positive (seconds)")
        if self.restart_backoff < 0:
            raise ConfigError("restart_backoff must be 0 or more (seconds)")
        if self.crash_loop < 1:
            raise ConfigError("crash_loop must be at least 1")
        if self.log_every <= 0:
            raise ConfigError("log_every must be positive (seconds)")

    def _check_remote(self) -> None:
        """The remote tier."""
        if self.remote_keep_last < 0 or self.remote_workers < 1 or self.remote_retries < 1:
            raise ConfigError(
                "remote_keep_last must be 0 or more, remote_workers and remote_retries at least 1"
            )
        if self.remote_part_mb < 5:
            raise ConfigError("remote_part_mb must be at least 5 (S3's smallest multipart part)")
        if self.remote_bandwidth_mb < 0 or self.remote_close_wait < 0 or self.remote_start_wait < 0:
            raise ConfigError(
                "remote_bandwidth_mb, remote_close_wait and remote_start_wait must be 0 or more"
            )

    def _check_ram(self) -> None:
        """The RAM tier and the memory budget."""
        if self.ram_every is not None and not self.ram_every > 0:
            raise ConfigError("ram_every must be positive (seconds)")
        if self.ram_slots not in (0, 1, 2):
            raise ConfigError(f"ram_slots must be 0 (as memory_budget allows), 1 or 2, not {self.ram_slots}")
        for name in ("ram_budget", "memory_budget"):
            value = getattr(self, name)
            if value is not None:
                try:
                    parse_size(value)
                except ValueError as err:
                    raise ConfigError(f"{name}: {err}") from None

    def _check_lists(self) -> None:
        """The settings that are lists in one string: ``no_restart_on``'s regexes,
        ``preempt_signals``' names."""
        for pat in self.no_restart_patterns:
            try:
                re.compile(pat)
            except re.error as err:
                raise ConfigError(f"no_restart_on: {pat!r} is not a regular expression ({err})") from None
        for name in self.signal_names:
            if name not in ("TERM", "USR1", "USR2", "INT", "HUP"):
                raise ConfigError(f"preempt_signals: unsupported signal {name!r}")

    @property
    def no_restart_patterns(self) -> list[str]:
        return [p.strip() for p in self.no_restart_on.split(";;") if p.strip()]

    @property
    def signal_names(self) -> list[str]:
        return [n.strip().upper().removeprefix("SIG") for n in self.preempt_signals.split(",") if n.strip()]

    @property
    def n_workers(self) -> int:
        # Twice the cores: each chunk task alternates compression (CPU) and write + fsync
        # (waiting on the disk), so half of them are usually off the CPU.
        return self.workers or min(8, 2 * (os.cpu_count() or 1))


_FIELDS = {f.name: f for f in dataclasses.fields(Settings)}


def _coerce(key: str, value: Any, *, from_text: bool) -> Any:
    if key == "tiers":
        if from_text:
            value = yaml.safe_load(value)
        return parse_rules(value)
    if key == "every" and isinstance(value, int | float) and not isinstance(value, bool):
        value = str(value)  # YAML's `every: 50` is a number; `every: 30s` a string
    hint = typing.get_type_hints(Settings)[key]
    args = typing.get_args(hint)
    optional = isinstance(hint, types.UnionType) and type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if value is None or (from_text and value.strip().lower() in ("", "none", "null")):
        if optional:
            return None
        raise ConfigError(f"{key} cannot be empty")
    try:
        if base is bool:
            if from_text:
                return value.strip().lower() in ("1", "true", "yes", "on")
            if not isinstance(value, bool):
                raise TypeError
            return value
        if base is int:
            if isinstance(value, bool) or (not from_text and not isinstance(value, int)):
                raise TypeError
            return int(value)
        if base is float:
            if isinstance(value, bool) or (not from_text and not isinstance(value, int | float)):
                raise TypeError
            return float(value)
        if not isinstance(value, str):
            raise TypeError
        return value
    except (TypeError, ValueError):
        raise ConfigError(f"{key} must be {base.__name__}, got {value!r}") from None


def load_settings(
    config_file: str | os.PathLike[str] | None = None,
    overrides: dict[str, Any] | None = None,
    *,
    env: dict[str, str] | None = None,
) -> tuple[Settings, dict[str, str]]:
    """Returns (settings, source of each non-default key). A ``config_file`` that is given must
    exist; otherwise ``./smartckpt.yaml`` is read when present."""
    env = dict(os.environ) if env is None else env
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    path = Path(config_file) if config_file else Path(CONFIG_FILE)
    if config_file and not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (yaml.YAMLError, OSError) as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} must be a mapping of settings")
        for key, value in data.items():
            if key not in _FIELDS:
                raise ConfigError(f"unknown setting '{key}' in {path}")
            values[key] = _coerce(key, value, from_text=False)
            sources[key] = str(path)
    for name, value in env.items():
        if not name.startswith(ENV_PREFIX) or name in _IGNORED_ENV:
            continue
        key = name[len(ENV_PREFIX) :].lower()
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting '{key}' in environment variable {name}")
        values[key] = _coerce(key, value, from_text=True)
        sources[key] = f"env {name}"
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown setting '{key}'")
        values[key] = _coerce(key, value, from_text=False) if key != "tiers" else parse_rules(value)
        sources[key] = "argument"
    return Settings(**values), sources


# Variables smartckpt uses for other purposes (test fault injection, the supervisor's handshake).
# The handshake names are hooks/_smartckpt_protocol.py's ENV_* (not imported: config must not
# depend on the hooks package).
_IGNORED_ENV = {
    "SMARTCKPT_TEST_FAULTS",
    "SMARTCKPT_FAULT",
    "SMARTCKPT_FAULT_RANK",
    "SMARTCKPT_FAULT_MODE",
    "SMARTCKPT_CONFIG",
    "SMARTCKPT_RUN_DIR",
    "SMARTCKPT_RUN_ID",
    "SMARTCKPT_ATTEMPT",
    "SMARTCKPT_HOOKS_DIR",
    "SMARTCKPT_HOOKS_LOADED",
    "SMARTCKPT_RAM_AREA",
    "SMARTCKPT_RAM_BYTES",
}


def parse_every(text: str) -> tuple[int | None, float | None]:
    """``50`` -> (50, None) steps; ``30s``/``5m``/``1h`` -> (None, seconds). ValueError if neither."""
    t = text.strip().lower()
    m = re.fullmatch(r"(\d+)(?:\s*steps?)?", t)
    if m:
        n = int(m.group(1))
        if n < 1:
            raise ValueError("a step interval must be at least 1")
        return n, None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|m|min|h)", t)
    if m:
        sec = float(m.group(1)) * {"s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}[m.group(2)]
        if sec <= 0:
            raise ValueError("a duration must be positive")
        return None, sec
    raise ValueError(f"expected steps (50) or a duration (30s, 5m, 1h), not {text!r}")


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``8G``, ``512M``, ``1.5GiB``, ``1048576`` -> bytes (powers of 1024). ValueError if not a size."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", str(text).strip().lower())
    if m is None:
        raise ValueError(f"expected a size (8G, 512M, 1.5GiB or bytes), not {text!r}")
    size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size <= 0:
        raise ValueError("a size must be positive")
    return size


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: v for k, v in dataclasses.asdict(value).items() if v is not None}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def public_settings(settings: Settings) -> dict[str, Any]:
    """Every setting as a JSON-ready value, in declaration order, with a remote URL shown without
    its credentials: what ``config show`` prints and a run record keeps."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if f.name == "remote" and value:  # a URL may carry credentials: never write them
            from smartckpt_cli.remote.replica import display_url

            value = display_url(value)
        out[f.name] = _plain(value)
    return out
