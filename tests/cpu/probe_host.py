"""One Python that imports torch and vLLM's config once, and runs each probe script in a
process forked from it.

    python tests/cpu/probe_host.py    (started by ProbeHost; requests on standard input)

The vLLM probes (rank_geometry_probe.py, rank_weights_probe.py, mtp_draft_probe.py) each run
in a process of their own, as each initialises torch.distributed or patches vLLM's platform
choices for the process; forking them from here instead of starting a fresh interpreter
spares each one the import of torch and ``vllm.config`` (about 10 s on two shared cores).
Only :data:`PRELOADED` is imported before the fork, the modules every one of those probes
imports first, before it pins or mocks anything: no vLLM object is built, no platform is
asked and no thread runs here, so a child starts as a fresh interpreter would be after those
imports. A child gets the request's environment, arguments and ``sys.path[0]`` (the probe's
directory) as a fresh ``python PROBE ARGS`` would, writes its standard output and error to
files, and leaves with ``os._exit`` (its exit status is the probe's).

Protocol: one JSON request a line, ``{"probe", "args", "env", "stdout", "stderr"}``; the host
answers ``{"pid": N}`` when the child is forked and ``{"returncode": N}`` when it has ended.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from types import TracebackType

PRELOADED = ("torch", "vllm.config", "vllm.model_executor.layers.quantization")


class ProbeHost:
    """The test side: start the host, run probes through it, stop it."""

    def __init__(self) -> None:
        self.scratch = tempfile.TemporaryDirectory(prefix="probe-host-")
        self.log = Path(self.scratch.name) / "host.err"
        with self.log.open("w") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
            )
        self.pending = b""

    def __enter__(self) -> ProbeHost:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        assert self.process.stdout is not None
        self.process.stdout.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.scratch.cleanup()

    def _answer(self, timeout: float) -> dict:
        """The host's next answer line (read from the pipe unbuffered, so that a line
        already read is never left waiting in a buffer ``select`` cannot see)."""
        assert self.process.stdout is not None
        fd = self.process.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                raise TimeoutError(f"no answer from the probe host in {timeout:.0f} s")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(
                    f"the probe host exited ({self.process.wait()}): {self.log.read_text()[-3000:]}"
                )
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(
        self, probe: Path, arguments: list[str], timeout: float, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``python PROBE ARGUMENTS`` with ``env`` (default: this process's environment), in
        a child of the host; its output as :func:`subprocess.run` gives it."""
        assert self.process.stdin is not None
        out = Path(self.scratch.name) / "stdout"
        err = Path(self.scratch.name) / "stderr"
        request = {
            "probe": str(probe),
            "args": list(arguments),
            "env": dict(os.environ if env is None else env),
            "stdout": str(out),
            "stderr": str(err),
        }
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        pid = self._answer(timeout=60)["pid"]
        try:
            returncode = self._answer(timeout)["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._answer(timeout=60)  # the killed child's status: the host is free again
            raise
        argv = [sys.executable, str(probe), *arguments]
        return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())


def _run_child(request: dict) -> int:
    """In the forked child: become ``python PROBE ARGS`` and run it."""
    import runpy
    import traceback

    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    probe = request["probe"]
    sys.argv = [probe, *request["args"]]
    sys.path[0] = os.path.dirname(os.path.abspath(probe))
    try:
        runpy.run_path(probe, run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def serve() -> int:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_child(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
