#!/usr/bin/env bash
# Installs and starts shardd on a TPU VM worker. Runs as the VM's startup script on every
# worker of a slice (gcloud ... --metadata-from-file=startup-script=startup.sh); idempotent,
# and running it again after publishing a new wheel upgrades the worker.
# The config is the same on every worker: host.index and host.count are "auto" (read from the
# metadata server's agent-worker-number and worker-network-endpoints at start).
#
# It ends with the units installed and started, or says why it could not (an invalid config,
# no wheel). What the daemon needs later is not waited for here: the store and its
# credentials are asked only after the units are started, and a trainer user that does not
# exist yet is a warning ("shardd: warning: ..."); systemd starts the daemon again every
# RestartSec until it can serve (journalctl -u shardd says why it cannot yet).
#
# Metadata keys it reads (set them when creating the slice, see README.md in this directory):
#   shardd-wheel    gs:// URL of the shardd wheel (docs/install.md: one wheel holds the daemon
#                   and the Python client; keep the wheel's own file name), or
#   shardd-index    the "simple" URL of a Python package index that holds it (Artifact
#                   Registry, a devpi, ...); only that index is asked, never PyPI;
#   shardd-version  with shardd-index: the version to install (default: the newest there)
#   shardd-config   the config (TOML): the [datasets...], and any other key to change
#                   ([cache] dir and max_size, [server] metrics_addr, ...). Merged over the
#                   defaults below table by table by shardd itself (`shardd merge-config`):
#                   a key in the metadata wins, the defaults' other keys stay.
#   shardd-user     the user that runs the trainers: added to group shardd, which may open
#                   the socket; optional (one that does not exist yet: a warning, README.md)
#
# The wheel goes to /opt/shardd (its daemon: /opt/shardd/bin/shardd), and the systemd units
# come from that very binary (`shardd install-units`), so binary and units always match.
# GCE_METADATA_HOST names another metadata server (as for Google's libraries and the daemon);
# SHARDD_ROOT installs under another root directory (the tests, an image build).
set -euo pipefail

root=${SHARDD_ROOT:-}
metadata=${GCE_METADATA_HOST:-metadata.google.internal}

warnings=0
warn() {
    echo "shardd: warning: $*" >&2
    warnings=$((warnings + 1))
}

# An attribute's value; empty when it is not set (404). A metadata server that does not
# answer yet (refused, a timeout, a 5xx) is asked again every second, for a minute at most.
md() {
    local reply code tries=0
    while :; do
        reply=$(curl -s --max-time 10 -w '\n%{http_code}' -H "Metadata-Flavor: Google" \
            "http://$metadata/computeMetadata/v1/instance/attributes/$1") || true
        code=${reply##*$'\n'}
        case $code in
            200) printf '%s' "${reply%$'\n'*}"; return 0 ;;
            404) return 0 ;;
        esac
        tries=$((tries + 1))
        if [ "$tries" -ge 60 ]; then
            echo "shardd: the metadata server at $metadata did not answer for $1 in $tries tries (last: HTTP $code)" >&2
            return 1
        fi
        if [ "$tries" = 1 ]; then
            echo "shardd: waiting for the metadata server at $metadata ($1: HTTP $code)" >&2
        fi
        sleep 1
    done
}

wheel_url=$(md shardd-wheel)
index_url=$(md shardd-index)
version=$(md shardd-version)
user_config=$(md shardd-config)
trainer=$(md shardd-user)
if [ -z "$user_config" ] || [ -z "$wheel_url$index_url" ]; then
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

# The group that may open the socket, and the service's user: before the config, whose check
# looks up server.socket_group. The service has DynamicUser=yes and no User=, so its user is
# named after the unit: "shardd". systemd refuses to make a dynamic user of a name that a
# static group already has, and takes a static user of that name as it is: so the user is
# made here, beside its group.
getent group shardd >/dev/null || groupadd --system shardd
getent passwd shardd >/dev/null ||
    useradd --system --gid shardd --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin shardd
if [ -n "$trainer" ] && ! why=$(usermod -aG shardd "$trainer" 2>&1); then
    warn "user $trainer was not added to group shardd ($why), so its trainers cannot open" \
        "the socket yet; once the user exists: sudo usermod -aG shardd $trainer; an OS Login" \
        "user: see \"Trainers and the socket\" in deploy/tpu-vm/README.md"
fi

# The config: these defaults (socket and cache where the units expect them, the host found at
# start), with shardd-config merged over them table by table (the metadata's keys win) by
# shardd itself, which validates the result before it replaces config.toml. Both inputs stay
# beside it. Checked offline: no store and no credentials are asked before the units exist.
install -d -m 0755 "$root/etc/shardd"
cat > "$root/etc/shardd/defaults.toml" <<'TOML'
# The defaults of deploy/tpu-vm/startup.sh: shardd-config.toml (the metadata) is merged over
# them into config.toml at every boot.
[server]
socket = "/run/shardd/shardd.sock"
# This host only (the Ops Agent, curl, shardd status). For a Prometheus elsewhere set
# [server] metrics_addr = "0.0.0.0:9464" in shardd-config, and allow tcp:9464 from it alone.
metrics_addr = "127.0.0.1:9464"

[host]
index = "auto"
count = "auto"

[cache]
dir = "/var/cache/shardd"
TOML
printf '%s\n' "$user_config" > "$root/etc/shardd/shardd-config.toml"
"$shardd" merge-config "$root/etc/shardd/defaults.toml" "$root/etc/shardd/shardd-config.toml" \
    -o "$root/etc/shardd/config.toml"
"$shardd" check --offline --config "$root/etc/shardd/config.toml"

# The units of the installed build, with the drop-ins the config needs (a cache on another
# disk, the socket's mode), then started.
install -d -m 0755 "$root/etc/systemd/system"
"$shardd" install-units --dir "$root/etc/systemd/system" --config "$root/etc/shardd/config.toml"
systemctl daemon-reload
systemctl enable --now shardd.socket
systemctl enable shardd.service
# Starts it, or after an upgrade runs the new binary (trainers' streams reconnect and resume).
# A daemon that cannot serve yet exits, and systemd starts it again every RestartSec.
if ! systemctl restart shardd.service; then
    warn "shardd.service did not start yet; systemd starts it again every 2 s until it can" \
        "serve: journalctl -u shardd says why"
fi
systemctl --no-pager status shardd.service || true

# Now the store, with the credentials the daemon uses: every shard asked for. What fails here
# (no credentials yet, a missing shard) is reported, not fatal: the daemon is installed, and
# retries until it can serve.
echo "shardd: the units are started; now asking the store for every shard" >&2
if ! "$shardd" check --config "$root/etc/shardd/config.toml"; then
    warn "the store check failed (above); the daemon is installed and retries until it can" \
        "serve: journalctl -u shardd"
fi
if [ "$warnings" = 0 ]; then
    echo "shardd: installed and started" >&2
else
    echo "shardd: installed and started, with $warnings warning$([ "$warnings" = 1 ] || echo s) above" >&2
fi
