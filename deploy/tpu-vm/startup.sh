#!/usr/bin/env bash
# Installs and starts shardd on a TPU VM worker. Runs as the VM's startup script on every
# worker of a slice (gcloud ... --metadata-from-file=startup-script=startup.sh); idempotent.
# The config is the same on every worker: host.index and host.count are "auto" (read from the
# metadata server's agent-worker-number and worker-network-endpoints at start).
#
# Metadata keys it reads (set them when creating the slice, see README.md in this directory):
#   shardd-binary   gs:// URL of a linux x86_64 shardd binary (release build)
#   shardd-config   the [datasets...] part of the config (TOML), appended to the defaults below
#   shardd-user     the user that runs the trainers (gets access to the socket); optional
set -euo pipefail

md() {
    curl -sf -H "Metadata-Flavor: Google" \
        "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1" || true
}

binary_url=$(md shardd-binary)
datasets=$(md shardd-config)
trainer=$(md shardd-user)
if [ -z "$binary_url" ] || [ -z "$datasets" ]; then
    echo "shardd: metadata shardd-binary and shardd-config are required" >&2
    exit 1
fi

# The binary: gcloud storage is on every TPU VM image.
tmp=$(mktemp)
gcloud storage cp "$binary_url" "$tmp"
install -m 0755 "$tmp" /usr/local/bin/shardd
rm -f "$tmp"

# The config: socket and cache where the units expect them; the host found at start.
install -d -m 0755 /etc/shardd
cat > /etc/shardd/config.toml <<TOML
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
/usr/local/bin/shardd check --config /etc/shardd/config.toml

# The units, and the group that may open the socket.
getent group shardd >/dev/null || groupadd --system shardd
if [ -n "$trainer" ]; then
    usermod -aG shardd "$trainer"
fi
units=https://raw.githubusercontent.com/shardd/shardd/main/deploy/systemd
for unit in shardd.service shardd.socket; do
    if [ -f "/opt/shardd/deploy/systemd/$unit" ]; then
        install -m 0644 "/opt/shardd/deploy/systemd/$unit" "/etc/systemd/system/$unit"
    else
        curl -sf "$units/$unit" -o "/etc/systemd/system/$unit"
    fi
done
systemctl daemon-reload
systemctl enable --now shardd.socket shardd.service
systemctl --no-pager status shardd.service || true
