#!/usr/bin/env bash
# Installs and starts shardd on a TPU VM worker. Runs as the VM's startup script on every
# worker of a slice (gcloud ... --metadata-from-file=startup-script=startup.sh); idempotent,
# and running it again after publishing a new wheel upgrades the worker.
# The config is the same on every worker: host.index and host.count are "auto" (read from the
# metadata server's agent-worker-number and worker-network-endpoints at start).
#
# Metadata keys it reads (set them when creating the slice, see README.md in this directory):
#   shardd-wheel    gs:// URL of the shardd wheel (docs/install.md: one wheel holds the daemon
#                   and the Python client; keep the wheel's own file name), or
#   shardd-index    the "simple" URL of a Python package index that holds it (Artifact
#                   Registry, a devpi, ...); only that index is asked, never PyPI;
#   shardd-version  with shardd-index: the version to install (default: the newest there)
#   shardd-config   the [datasets...] part of the config (TOML), appended to the defaults below
#   shardd-user     the user that runs the trainers (gets access to the socket); optional
#
# The wheel goes to /opt/shardd (its daemon: /opt/shardd/bin/shardd), and the systemd units
# come from that very binary (`shardd install-units`), so binary and units always match.
# GCE_METADATA_HOST names another metadata server (as for Google's libraries and the daemon);
# SHARDD_ROOT installs under another root directory (the tests, an image build).
set -euo pipefail

root=${SHARDD_ROOT:-}
metadata=${GCE_METADATA_HOST:-metadata.google.internal}

md() {
    curl -sf -H "Metadata-Flavor: Google" \
        "http://$metadata/computeMetadata/v1/instance/attributes/$1" || true
}

wheel_url=$(md shardd-wheel)
index_url=$(md shardd-index)
version=$(md shardd-version)
datasets=$(md shardd-config)
trainer=$(md shardd-user)
if [ -z "$datasets" ] || [ -z "$wheel_url$index_url" ]; then
    echo "shardd: metadata shardd-config, and shardd-wheel or shardd-index, are required" >&2
    exit 1
fi
if [ -n "$wheel_url" ] && [ -n "$index_url" ]; then
    echo "shardd: metadata shardd-wheel and shardd-index are both set; set one" >&2
    exit 1
fi

# The wheel, into its own directory (no virtualenv needed, the system's Python untouched).
command -v pip3 >/dev/null || { apt-get update -qq && apt-get install -y -qq python3-pip; }
prefix=$root/opt/shardd
if [ -n "$wheel_url" ]; then
    # gcloud storage is on every TPU VM image; the VM's service account reads the bucket.
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    gcloud storage cp "$wheel_url" "$tmp/"
    wheels=("$tmp"/*.whl)
    pip3 install --quiet --no-deps --upgrade --target "$prefix" "${wheels[0]}"
else
    pip3 install --quiet --no-deps --upgrade --target "$prefix" --index-url "$index_url" \
        "shardd${version:+==$version}"
fi
shardd=$prefix/bin/shardd
"$shardd" --version
install -d -m 0755 "$root/usr/local/bin"
ln -sfn "$shardd" "$root/usr/local/bin/shardd"

# The config: socket and cache where the units expect them; the host found at start.
install -d -m 0755 "$root/etc/shardd"
cat > "$root/etc/shardd/config.toml" <<TOML
[server]
socket = "/run/shardd/shardd.sock"
metrics_addr = "127.0.0.1:9464"

[host]
index = "auto"
count = "auto"

[cache]
dir = "/var/cache/shardd"

${datasets}
TOML
"$shardd" check --config "$root/etc/shardd/config.toml"

# The group that may open the socket, and the units of the installed build.
getent group shardd >/dev/null || groupadd --system shardd
if [ -n "$trainer" ]; then
    usermod -aG shardd "$trainer"
fi
install -d -m 0755 "$root/etc/systemd/system"
"$shardd" install-units --dir "$root/etc/systemd/system"
systemctl daemon-reload
systemctl enable --now shardd.socket
systemctl enable shardd.service
# Starts it, or after an upgrade runs the new binary (trainers' streams reconnect and resume).
systemctl restart shardd.service
systemctl --no-pager status shardd.service || true
