"""The one wheel: built from the repository root (`pip wheel .`, maturin), installed into a
fresh virtualenv with nothing else, it carries the daemon (`shardd` on the venv's PATH) and the
Python package (client, shardd.torch, shardd.grain), all of one version."""

import json
import os
import subprocess
import sys
import tomllib
import zipfile

import pytest

from conftest import ROOT


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory):
    path = tmp_path_factory.mktemp("fresh") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    subprocess.run([path / "bin" / "python", "-m", "pip", "install", "-q", "--no-index",
                    "--no-deps", "--disable-pip-version-check", str(wheel)], check=True)
    return path


def run(*argv, **kw):
    out = subprocess.run([str(a) for a in argv], capture_output=True, text=True, **kw)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_wheel_is_manylinux_and_holds_the_daemon_and_the_package(wheel):
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    assert wheel.name == f"shardd-{version}-py3-none-manylinux_2_34_x86_64.whl"
    names = set(zipfile.ZipFile(wheel).namelist())
    # Every module of the package (the client is split into private modules, shardd/_*.py).
    package = {f"shardd/{p.name}" for p in (ROOT / "clients/python/shardd").glob("*.py")}
    assert {"shardd/client.py", "shardd/torch.py", "shardd/grain.py", "shardd/_frames.py"} <= package
    assert package | {f"shardd-{version}.data/scripts/shardd",
                      "shardd/libshardd_decode.so"} <= names
    # The package's files are those of clients/python, byte for byte.
    with zipfile.ZipFile(wheel) as z:
        for name in package:
            assert z.read(name) == (ROOT / "clients/python" / name).read_bytes(), name


def test_the_compiled_decoder_in_the_wheel_needs_no_newer_glibc_than_its_tag(wheel, tmp_path):
    """maturin checks the daemon's symbols against manylinux_2_34, not a library the wheel
    only includes (the client's decoder, from build.rs): checked here, with binutils (the
    Rust toolchain's linker comes with them)."""
    import re

    lib = tmp_path / "libshardd_decode.so"
    lib.write_bytes(zipfile.ZipFile(wheel).read("shardd/libshardd_decode.so"))
    symbols = run("objdump", "-T", lib)
    versions = {tuple(map(int, v.split("."))) for v in re.findall(r"GLIBC_([0-9.]+)", symbols)}
    assert versions and max(versions) <= (2, 34), sorted(versions)
    # It needs CPython's functions from the process, and no libpython or anything else odd.
    needed = set(re.findall(r"NEEDED\s+(\S+)", run("objdump", "-p", lib)))
    assert needed <= {"libc.so.6", "libgcc_s.so.1", "libm.so.6", "ld-linux-x86-64.so.2"}, needed
    assert "PyDict_New" in symbols


def test_installed_binary_runs_the_demo_and_versions_agree(venv, tmp_path):
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    shardd = venv / "bin" / "shardd"
    assert run(shardd, "--version") == f"shardd {version}\n"
    # The installed client decodes with the compiled decoder the wheel carries (not the one
    # conftest.py names for the rest of the suite).
    probe = ("import importlib.metadata, json, shardd, shardd.client, shardd._decode as d; "
             "print(json.dumps([shardd.__version__, importlib.metadata.version('shardd'), "
             "shardd.__file__, d.DECODER, d.batch(1, ['cls'], ['u'], bytes([0, 0, 1, 0, 1, 0, 0, "
             "0, 0, 0, 0, 0, 2, 0, 0, 0]), b'k42', 's')[0]['cls'].decode()]))")
    env = {k: v for k, v in os.environ.items() if k != "SHARDD_DECODER"}
    package, metadata, where, decoder, field = json.loads(
        run(venv / "bin" / "python", "-c", probe, env=env))
    assert package == metadata == version
    assert where.startswith(str(venv))  # the wheel's copy, not the repository's
    assert (decoder, field) == ("compiled", "42")
    demo = run(shardd, "demo", timeout=300)
    assert "every sample exactly once" in demo, demo
    # The units it installs run the binary it was installed as.
    run(shardd, "install-units", "--dir", tmp_path)
    service = (tmp_path / "shardd.service").read_text()
    assert f"\nExecStart={shardd.resolve()} serve --config /etc/shardd/config.toml\n" in service
    assert (tmp_path / "shardd.socket").read_text() == (ROOT / "deploy/systemd/shardd.socket").read_text()
