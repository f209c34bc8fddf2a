"""Try a plugin's entry point in a subprocess, with a time limit, before it is imported here.

Importing a plugin runs its code in the server's process: an import that waits forever (for a
device, a lock, a network mount) or a register hook that loops would hang discovery for good, and
one that calls ``os._exit`` or crashes would end the server. :func:`run_probe` first does both in
a fresh interpreter - import the entry point, call its ``attn_core_register_backends`` with a
``register`` that only collects - and says whether that finished within the limit. The registry
quarantines a plugin whose probe did not finish or ended its process, and loads the others
in-process as before. A probe that *raised* is not judged: the in-process load raises the same
exception and reports it with the message it always had.

A probe costs an interpreter start plus the plugin's imports (about 1.5 s with torch), so
successful probes are cached (:class:`ProbeCache`) by interpreter, distribution, version and entry
point: start-ups after the first pay nothing. Only successes are cached; a plugin that hung is
probed again at the next start-up.

Settings:

- ``ATTN_CORE_PLUGIN_TIMEOUT``: seconds a probe may take (default 30); ``0`` turns probing off.
- ``ATTN_CORE_PROBE_CACHE``: the cache file; ``off`` turns the cache off. Default
  ``$XDG_CACHE_HOME/attn-core/plugin-probes.json`` (``~/.cache/...`` without XDG_CACHE_HOME).

Limits, by design: a probe shows that a plugin *can* finish; one that hangs only sometimes, or only
in the server's process, can still hang it, and a cached verdict is not revisited until the
distribution's version changes (an editable install keeps its version while its code changes:
delete the cache file, or set ``ATTN_CORE_PROBE_CACHE=off``, while developing a plugin). Where
``sys.executable`` is not a Python interpreter (a server that embeds Python), probes are skipped.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

__all__ = [
    "DEFAULT_TIMEOUT",
    "ENV_CACHE",
    "ENV_TIMEOUT",
    "ProbeCache",
    "ProbeResult",
    "default_cache_path",
    "probe_interpreter",
    "run_probe",
    "timeout_from",
]

ENV_TIMEOUT = "ATTN_CORE_PLUGIN_TIMEOUT"
ENV_CACHE = "ATTN_CORE_PROBE_CACHE"
DEFAULT_TIMEOUT = 30.0
#: Probes run side by side (most of a probe is waiting); at most this many at once.
MAX_PARALLEL = 8
_OFF = frozenset({"0", "off", "false", "no", "none"})
_CACHE_FORMAT = 1

# Run by the probe interpreter. Markers go to the real stdout, prefixed with a per-probe token, so
# that whatever the plugin prints cannot be taken for one. os._exit at the end: a plugin's
# non-daemon threads or atexit handlers must not keep a finished probe running.
_SCRIPT = r"""
import json, os, sys
args = json.loads(sys.argv[1])
out = sys.__stdout__

def say(word):
    out.write("\n" + args["token"] + " " + word + "\n")
    out.flush()

say("started")
sys.path[:] = args["path"]
stage = "import"
try:
    from importlib.metadata import EntryPoint
    obj = EntryPoint(name=args["name"], value=args["value"], group=args["group"]).load()
    say("imported")
    stage = "register"
    hook = getattr(obj, "attn_core_register_backends", None)
    if callable(hook):
        import inspect
        wanted = inspect.signature(hook).parameters
        hook(**({"register": lambda backend: None} if "register" in wanted else {}))
    say("registered")
except BaseException:
    say("raised " + stage)
os._exit(0)
"""


def _check_seconds(seconds: object, label: str) -> float:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, (int, float))
        or not math.isfinite(seconds)
        or seconds < 0
    ):
        raise ValueError(f"{label}: expected seconds (a finite number >= 0; 0 turns the probe off)")
    return float(seconds)


def timeout_from(value: float | None) -> float:
    """The probe time limit in seconds: ``value``, else ``ATTN_CORE_PLUGIN_TIMEOUT``, else 30.

    :raises ValueError: a negative, non-finite or non-numeric limit; the message names where it
        came from (the argument or the variable).
    """
    if value is not None:
        return _check_seconds(value, f"plugin_timeout={value!r}")
    text = os.environ.get(ENV_TIMEOUT, "")
    if not text.strip():
        return DEFAULT_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    return _check_seconds(seconds, f"{ENV_TIMEOUT}={text!r}")


def probe_interpreter() -> str | None:
    """The interpreter probes run in (``sys.executable``), or None where it is not a Python
    (a server that embeds Python reports its own binary, which must not be started)."""
    exe = sys.executable
    name = os.path.basename(exe or "")
    if exe and re.fullmatch(r"(python|pypy)[0-9.]*[a-z]?(\.exe)?", name, re.IGNORECASE):
        return exe
    return None


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe saw.

    :ivar stage: ``"import"`` or ``"register"`` when the plugin must be quarantined (it did not
        finish in time, or ended its process); None when it may load in-process.
    :ivar reason: why, for the quarantine record.
    :ivar finished: it imported and registered without an exception (worth caching).
    :ivar seconds: how long the probe ran.
    """

    stage: str | None
    reason: str = ""
    finished: bool = False
    seconds: float = 0.0


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the probe and whatever it started (it leads its own process group)."""
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except ProcessLookupError:
        pass


def run_probe(ep: metadata.EntryPoint, timeout: float) -> ProbeResult:
    """Import ``ep`` and call its register hook in a subprocess, for at most ``timeout`` s.

    The subprocess gets this process's ``sys.path`` and environment (with probing turned off, so
    that a plugin which discovers plugins itself cannot start probes of its own).
    """
    exe = probe_interpreter()
    if exe is None:
        return ProbeResult(None)
    token = secrets.token_hex(8)
    payload = {
        "token": token,
        "path": list(sys.path),
        "name": ep.name,
        "value": ep.value,
        "group": ep.group,
    }
    start = time.monotonic()
    proc = subprocess.Popen(
        [exe, "-c", _SCRIPT, json.dumps(payload)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, ENV_TIMEOUT: "0"},
        start_new_session=True,
    )
    timed_out = False
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill(proc)
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a child that left the group still holds the pipe
            out = b""
    seconds = time.monotonic() - start
    marks = {
        line[len(token) + 1 :]
        for line in out.decode("utf-8", "replace").splitlines()
        if line.startswith(token + " ")
    }
    if "registered" in marks:
        return ProbeResult(None, finished=True, seconds=seconds)
    if "started" not in marks or any(m.startswith("raised ") for m in marks):
        # Not judged: the interpreter did not reach the plugin, or the plugin raised, which the
        # in-process load reports with its usual message.
        return ProbeResult(None, seconds=seconds)
    stage = "register" if "imported" in marks else "import"
    where = f"probe in a subprocess; {ENV_TIMEOUT} sets the limit"
    if timed_out:
        if stage == "import":
            reason = f"did not finish importing within {timeout:g} s ({where})"
        else:
            reason = f"attn_core_register_backends did not return within {timeout:g} s ({where})"
        return ProbeResult(stage, reason, seconds=seconds)
    doing = "importing" if stage == "import" else "in attn_core_register_backends"
    rc = proc.returncode
    if rc is not None and rc < 0:
        try:
            ended = f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            ended = f"was killed by signal {-rc}"
    else:
        ended = f"exited with status {rc}"
    reason = f"the probe process {ended} while {doing}, without raising (probe in a subprocess)"
    return ProbeResult(stage, reason, seconds=seconds)


def default_cache_path() -> Path | None:
    """``$XDG_CACHE_HOME/attn-core/plugin-probes.json``, else under ``~/.cache``; None when
    neither is an absolute path (no home directory)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative value is ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attn-core" / "plugin-probes.json" if os.path.isabs(base) else None


class ProbeCache:
    """Entry points whose probe finished, in a small JSON file shared by start-ups.

    The file holds ``{"format": 1, "probes": {key: {"seconds": s}}}``; a key is the JSON list
    ``[interpreter, distribution, version, entry point name, entry point value]``. A file that
    cannot be read is treated as empty and one that cannot be written is left alone: either costs
    a probe at the next start-up, nothing else.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path is not None else None
        self._entries = self._read()
        self._new: dict[str, dict[str, float]] = {}

    @classmethod
    def from_setting(cls, setting: str | os.PathLike[str] | bool | None) -> ProbeCache:
        """The cache a :class:`~attn_core.registry.Registry` argument names: a path, False (no
        cache), or None / True (``ATTN_CORE_PROBE_CACHE``, else :func:`default_cache_path`)."""
        if setting is False:
            return cls(None)
        if setting is None or setting is True:
            text = os.environ.get(ENV_CACHE, "").strip()
            if text.lower() in _OFF:
                return cls(None)
            return cls(text or default_cache_path())
        return cls(setting)

    @staticmethod
    def key(ep: metadata.EntryPoint, distribution: str | None, version: str) -> str | None:
        """The cache key of ``ep``, or None for an entry point of no known distribution."""
        if distribution is None:
            return None
        return json.dumps([sys.executable, distribution, version, ep.name, ep.value])

    def __contains__(self, key: str | None) -> bool:
        return key is not None and (key in self._entries or key in self._new)

    def add(self, key: str | None, seconds: float) -> None:
        if key is not None and self.path is not None:
            self._new[key] = {"seconds": round(seconds, 3)}

    def _read(self) -> dict[str, dict[str, float]]:
        if self.path is None:
            return {}
        try:
            payload = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(payload, dict) or payload.get("format") != _CACHE_FORMAT:
            return {}
        probes = payload.get("probes")
        return dict(probes) if isinstance(probes, dict) else {}

    def save(self) -> None:
        """Write the new entries, merged into what the file holds now (another start-up may have
        written it meanwhile); atomically, so a reader never sees half a file."""
        if self.path is None or not self._new:
            return
        entries = {**self._read(), **self._new}
        payload = json.dumps({"format": _CACHE_FORMAT, "probes": entries}, indent=1)
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".plugin-probes-")
            with os.fdopen(fd, "w") as f:
                f.write(payload)
            os.replace(tmp, self.path)
        except OSError:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            return
        self._entries, self._new = entries, {}
