"""probe_host.py: a probe forked from the host runs as ``python PROBE ARGS`` would (its
arguments, environment, ``sys.path[0]``, output and exit status), each in a process of its
own (what one probe changes of an imported module, the next does not see), and a probe that
outlives its timeout is killed without leaving the host stuck."""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest
from patchset_helpers import run_json_probe
from probe_host import ProbeHost


def _probe(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / "probes" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def test_a_probe_runs_as_a_fresh_interpreter_would(vllm_probe_host: ProbeHost, tmp_path):
    probe = _probe(
        tmp_path,
        "report.py",
        """\
        import json, os, sys
        print("a line before the report")
        print("to stderr", file=sys.stderr)
        print(json.dumps({"argv": sys.argv[1:], "path0": sys.path[0],
                          "env": os.environ.get("PROBE_HOST_TEST"), "main": __name__}))
        """,
    )
    env = {**os.environ, "PROBE_HOST_TEST": "from the request"}
    report = run_json_probe(probe, "a", "b c", timeout=60, env=env, host=vllm_probe_host)
    assert report == {
        "argv": ["a", "b c"],
        "path0": str(probe.parent),
        "env": "from the request",
        "main": "__main__",
    }
    done = vllm_probe_host.run(probe, [], timeout=60)
    assert done.returncode == 0 and done.stderr == "to stderr\n"
    assert done.stdout.splitlines()[0] == "a line before the report"
    assert json.loads(done.stdout.splitlines()[-1])["env"] is None


@pytest.mark.parametrize(
    ("source", "returncode", "stderr"),
    [
        ("import sys; sys.exit(3)\n", 3, ""),
        ("import sys; sys.exit('a message')\n", 1, "a message\n"),
        ("raise ValueError('a failing probe')\n", 1, "ValueError: a failing probe\n"),
    ],
)
def test_the_exit_status_is_the_probes(vllm_probe_host, tmp_path, source, returncode, stderr):
    done = vllm_probe_host.run(_probe(tmp_path, "exits.py", source), [], timeout=60)
    assert done.returncode == returncode
    assert done.stderr.endswith(stderr)


def test_each_probe_starts_from_the_host_not_from_the_last_probe(vllm_probe_host, tmp_path):
    """The preloaded modules are the host's: a probe that changes one changes its own copy."""
    change = _probe(
        tmp_path,
        "change.py",
        """\
        import json, vllm.config
        vllm.config.PROBE_HOST_TEST = 1
        print(json.dumps({"set": vllm.config.PROBE_HOST_TEST}))
        """,
    )
    look = _probe(
        tmp_path,
        "look.py",
        """\
        import json, sys, vllm.config
        print(json.dumps({"seen": hasattr(vllm.config, "PROBE_HOST_TEST"),
                          "preloaded": "vllm.config" in sys.modules}))
        """,
    )
    assert run_json_probe(change, timeout=60, host=vllm_probe_host) == {"set": 1}
    assert run_json_probe(look, timeout=60, host=vllm_probe_host) == {
        "seen": False,
        "preloaded": True,
    }


def test_a_probe_past_its_timeout_is_killed_and_the_host_goes_on(vllm_probe_host, tmp_path):
    sleeper = _probe(tmp_path, "sleeps.py", "import time\ntime.sleep(600)\n")
    with pytest.raises(TimeoutError, match="no answer from the probe host in 1 s"):
        vllm_probe_host.run(sleeper, [], timeout=1)
    quick = _probe(tmp_path, "quick.py", "print('{\"ok\": true}')\n")
    assert run_json_probe(quick, timeout=60, host=vllm_probe_host) == {"ok": True}
