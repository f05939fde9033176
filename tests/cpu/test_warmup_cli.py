"""`vllm-minimax warmup`: bad input exits 2 before building and changes nothing;
FlashInfer's cache path is keyed on its version and GPU architecture."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from probe_host import ProbeHost

from vllm_minimax import warmup
from vllm_minimax.cli import main

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "serve" / "h200-8x.yaml"


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(["warmup", *argv])
    return rc, capsys.readouterr().err


def test_missing_config_exits_2(tmp_path, capsys):
    rc, err = _run(capsys, "--config", str(tmp_path / "nope.yaml"), "--cache-dir", str(tmp_path))
    assert rc == 2
    assert f"serving config {tmp_path / 'nope.yaml'} does not exist" in err
    assert list(tmp_path.iterdir()) == []


def test_a_config_that_is_a_directory_is_named_as_one(tmp_path, capsys):
    (tmp_path / "configs").mkdir()
    rc, err = _run(capsys, "--config", str(tmp_path / "configs"), "--cache-dir", str(tmp_path))
    assert rc == 2
    assert f"serving config {tmp_path / 'configs'} is not a file" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configs"]


def test_cache_dir_under_a_file_exits_2_naming_it(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, err = _run(capsys, "--config", str(CONFIG), "--cache-dir", str(blocker / "cache"))
    assert rc == 2
    assert f"{blocker / 'cache' / '.cache' / 'flashinfer'} is not writable" in err
    assert f"{blocker} is not a directory" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")
def test_full_cache_dir_exits_2_naming_it(capsys):
    """/proc reports no free space: a full file system, as the check sees it."""
    rc, err = _run(capsys, "--config", str(CONFIG), "--cache-dir", "/proc/warmup-test")
    assert rc == 2
    assert "/proc/warmup-test/.cache/flashinfer has 0 MiB free" in err


def test_full_check_compares_against_the_free_space(tmp_path):
    location = warmup.cache_location(tmp_path)
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    warmup.check_writable(location, min_free_bytes=1)
    with pytest.raises(warmup.WarmupError, match=f"{location.flashinfer_root} has"):
        warmup.check_writable(location, min_free_bytes=free + 2**30)
    assert list(tmp_path.iterdir()) == []


def test_cache_location_follows_flashinfer_workspace_base(tmp_path, monkeypatch):
    monkeypatch.setenv(warmup.WORKSPACE_ENV, str(tmp_path / "base"))
    assert warmup.cache_location(None).flashinfer_root == tmp_path / "base/.cache/flashinfer"
    assert warmup.cache_location(tmp_path / "x").workspace_base == tmp_path / "x"
    monkeypatch.delenv(warmup.WORKSPACE_ENV)
    assert warmup.cache_location(None).workspace_base == Path.home()


def test_other_version_and_arch_caches_are_named_ignored(tmp_path):
    location = warmup.cache_location(tmp_path)
    for version, arch in (("0.7.4", "90a"), ("0.7.3", "90a"), ("0.7.4", "120a")):
        (location.flashinfer_root / version / arch / "cached_ops").mkdir(parents=True)
    ignored = warmup.other_caches(location, "0.7.4", "90a")
    assert ignored == [
        location.flashinfer_root / "0.7.3" / "90a",
        location.flashinfer_root / "0.7.4" / "120a",
    ]


@pytest.mark.slow
def test_flashinfer_keys_its_cache_on_version_and_arch(tmp_path, vllm_probe_host: ProbeHost):
    """FlashInfer 0.7.4 itself puts its JIT cache (nvcc modules and CuTe-DSL
    objects) under <version>/<arch>: another version's or GPU's cache is never read. The
    probe imports FlashInfer afresh with the environment set, in a process forked from the
    session's probe host (which has torch imported, not FlashInfer)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import flashinfer\nfrom flashinfer.jit import env\n"
        "print(flashinfer.__version__); print(env.FLASHINFER_JIT_DIR)\n"
    )
    env = dict(
        os.environ, FLASHINFER_WORKSPACE_BASE=str(tmp_path), FLASHINFER_CUDA_ARCH_LIST="9.0a"
    )
    done = vllm_probe_host.run(probe, [], timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout.split()
    version, jit_dir = out[-2], Path(out[-1])
    assert version == "0.7.4"
    assert jit_dir == tmp_path / ".cache" / "flashinfer" / "0.7.4" / "90a" / "cached_ops"
