"""scripts/smoke-gpu on the CPU, against a fake `vllm` that serves the OpenAI API:
the tiny model is made for real, the fake server gets the fp8 index cache on SM90,
the script prints the selected indexer and the answer, and stops the server on exit."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from patchset_helpers import REPO_ROOT, installed_vllm_site, real_series_paths

from vllm_minimax import patchset

SMOKE = REPO_ROOT / "scripts" / "smoke-gpu"

FAKE_VLLM = textwrap.dedent(
    """\
    #!{python}
    # A stand-in for `vllm serve`: logs an indexer selection, answers /health and
    # /v1/completions, records its pid, and exits on SIGTERM.
    import argparse, json, os, signal, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    from pathlib import Path

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("model")
    parser.add_argument("--served-model-name")
    parser.add_argument("--port", type=int)
    parser.add_argument("--attention-config")
    args, _ = parser.parse_known_args()
    assert args.command == "serve" and (Path(args.model) / "config.json").is_file()
    Path(os.environ["FAKE_PID_FILE"]).write_text(str(os.getpid()))
    dtype = json.loads(args.attention_config)["indexer_kv_dtype"]
    impl = os.environ.get("FAKE_IMPL", "FlashInfer (msa_proxy_score + msa_topk_select)")
    print(f"INFO MiniMax M3 indexer: selected {{impl}} [indexer_kv_dtype={{dtype}}]", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body):
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({{}})

        def do_POST(self):
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert request["model"] == args.served_model_name
            words = len(request["prompt"].split())
            self._send({{"choices": [{{"text": " Paris"}}], "usage": {{"prompt_tokens": words}}}})

        def log_message(self, *_):
            pass

    HTTPServer(("127.0.0.1", args.port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake_env(tmp_path):
    """PATH with the fake `vllm`; PYTHONPATH with a scratch vLLM tree, series applied."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(FAKE_VLLM.format(python=sys.executable))
    fake.chmod(0o755)
    site = tmp_path / "site"
    for rel in ["vllm/_version.py", *real_series_paths()]:
        if (installed_vllm_site() / rel).is_file():
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(installed_vllm_site() / rel, site / rel)
    # A regular package, so that it shadows the installed vLLM on PYTHONPATH.
    (site / "vllm" / "__init__.py").write_text("")
    patchset.apply_series(site)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHONPATH": str(site),
        "PYTHON": sys.executable,
        "PORT": str(18000 + os.getpid() % 1000),
        "CAPABILITY": "9.0",
        "TMPDIR": str(scratch),
        "FAKE_PID_FILE": str(tmp_path / "server.pid"),
    }


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """One tiny model for the tests that pass TINY_MODEL (made in-process: quicker than the
    script's own)."""
    from vllm_minimax.tiny_model import make_tiny_model

    model = tmp_path_factory.mktemp("smoke-model") / "model"
    make_tiny_model(model)
    return model


def run_smoke(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SMOKE)], env=env, capture_output=True, text=True, timeout=180, check=False
    )


def assert_server_stopped(env: dict[str, str]) -> None:
    pid = int(Path(env["FAKE_PID_FILE"]).read_text())
    for _ in range(50):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"fake server {pid} still running after smoke-gpu exited")


def test_smoke_gpu_reports_selection_and_answer(fake_env):
    result = run_smoke(fake_env)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "smoke-gpu: GPU compute capability 9.0; indexer_kv_dtype fp8" in out
    assert (
        "smoke-gpu: MiniMax M3 indexer: selected FlashInfer (msa_proxy_score + msa_topk_select)"
        " [indexer_kv_dtype=fp8]" in out
    )
    assert "smoke-gpu: prompt tokens 2405, answer ' Paris'" in out
    assert "smoke-gpu: ok" in out.splitlines()
    assert_server_stopped(fake_env)
    assert not list(Path(fake_env["TMPDIR"]).glob("smoke-gpu.*")), "scratch directory left"


def test_smoke_gpu_fails_when_triton_is_selected_on_sm90(fake_env, tiny_model):
    env = {**fake_env, "TINY_MODEL": str(tiny_model)}
    result = run_smoke({**env, "FAKE_IMPL": "Triton (FlashInfer not used: test)"})
    assert result.returncode == 1
    assert "expected the FlashInfer indexer on compute capability 9.0" in result.stderr
    assert_server_stopped(fake_env)


def test_smoke_gpu_sources_the_environment_hook(fake_env, tiny_model, tmp_path):
    """The hook is sourced first: here it is what puts the patched vLLM on PYTHONPATH."""
    hook = tmp_path / "hook.sh"
    hook.write_text(f'export PYTHONPATH="{fake_env["PYTHONPATH"]}"\n')
    env = {**fake_env, "TINY_MODEL": str(tiny_model), "PYTHONPATH": ""}
    without = run_smoke(env)
    assert without.returncode == 1
    assert "the series is not applied to this vLLM" in without.stderr
    result = run_smoke({**env, "VLLM_MINIMAX_GPU_ENV_HOOK": str(hook)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "smoke-gpu: ok" in result.stdout.splitlines()
    assert_server_stopped(fake_env)


def test_smoke_gpu_without_a_vllm_command_runs_the_cli_module(fake_env, tiny_model, tmp_path):
    """Where no `vllm` command is on PATH (vLLM installed without console scripts), the
    script runs `$PYTHON -m vllm.entrypoints.cli.main`."""
    fake_vllm = Path(fake_env["PATH"].split(":")[0]) / "vllm"
    moved = tmp_path / "fake-vllm-cli"
    fake_vllm.rename(moved)
    python = tmp_path / "python"
    python.write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "-m vllm.entrypoints.cli.main" ]; then\n'
        f'    shift 2; exec "{moved}" "$@"\n'
        "fi\n"
        f'exec "{sys.executable}" "$@"\n'
    )
    python.chmod(0o755)
    path = ":".join(
        directory
        for directory in fake_env["PATH"].split(":")
        if not (Path(directory) / "vllm").exists()
    )
    env = {**fake_env, "TINY_MODEL": str(tiny_model), "PATH": path, "PYTHON": str(python)}
    result = run_smoke(env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "smoke-gpu: ok" in result.stdout.splitlines()
    assert_server_stopped(fake_env)
