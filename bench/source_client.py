"""The Python client of this source tree (clients/python), decoding as the wheel's does: with
the compiled decoder `cargo build` made (docs/client.md, "Decoding"), unless SHARDD_DECODER
says otherwise (``python``: the pure-Python decoder). Import it before ``shardd``."""

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python"))

if not os.environ.get("SHARDD_DECODER"):  # as tests/python/conftest.py: empty is unset
    built = sorted(ROOT.glob("target/*/build/shardd-*/out/libshardd_decode.so"),
                   key=lambda p: p.stat().st_mtime)
    if built:
        os.environ["SHARDD_DECODER"] = str(built[-1])


def decoder():
    """Which decoder the client uses, for a report's header."""
    from shardd import _decode

    return f"{_decode.DECODER} ({os.environ.get('SHARDD_DECODER') or 'none built'})"
