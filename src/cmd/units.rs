//! `shardd install-units`: writes the systemd units of `deploy/systemd/`, which are built into
//! the binary, so that a host that installed shardd (the wheel, a copied binary) gets the units
//! of exactly that build, from nowhere else; with `--config`, the drop-ins that config needs.
//! And `shardd merge-config`, which a TPU VM's start-up script uses to lay the config in the
//! instance metadata over its defaults (`deploy/tpu-vm/startup.sh`).

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The units, as committed in `deploy/systemd/`.
const UNITS: [(&str, &str); 2] = [
    (
        "shardd.service",
        include_str!("../../deploy/systemd/shardd.service"),
    ),
    (
        "shardd.socket",
        include_str!("../../deploy/systemd/shardd.socket"),
    ),
];

/// The binary the committed service unit runs.
const UNIT_BINARY: &str = "/usr/local/bin/shardd";

/// Where systemd looks for units an administrator installed.
pub const DEFAULT_DIR: &str = "/etc/systemd/system";

/// The units with `ExecStart` pointing at `binary`.
pub fn units(binary: &Path) -> Vec<(&'static str, String)> {
    let exec = format!("ExecStart={UNIT_BINARY} ");
    UNITS
        .iter()
        .map(|(name, text)| {
            let text = text.replace(&exec, &format!("ExecStart={} ", binary.display()));
            (*name, text)
        })
        .collect()
}

/// Writes the units into `dir` (each through a temporary file and a rename, mode 0644), with
/// `ExecStart` running this very binary. With `config`, also the drop-ins that config needs
/// ([`dropins`]), and removes those it no longer needs. Prints the paths written.
pub fn install(dir: &Path, config: Option<&Path>) -> anyhow::Result<()> {
    let binary = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .context("finding this binary's path")?;
    let dropins = match config {
        Some(path) => {
            let parsed = crate::config::Config::load(path)?;
            dropins(&parsed, path)?
        }
        None => Vec::new(),
    };
    for (name, text) in units(&binary) {
        let path = write(dir, name, &text)?;
        println!("{}", path.display());
    }
    for d in dropins {
        let sub = dir.join(d.dir);
        let path = sub.join(DROPIN);
        match d.text {
            Some(text) => {
                std::fs::create_dir_all(&sub)
                    .with_context(|| format!("creating {}", sub.display()))?;
                write(&sub, DROPIN, &text)?;
                println!("{}", path.display());
                eprintln!("shardd: {}: {}", path.display(), d.why);
            }
            None => match std::fs::remove_file(&path) {
                Ok(()) => {
                    eprintln!("shardd: removed {} ({})", path.display(), d.why);
                    let _ = std::fs::remove_dir(&sub); // only if nothing else is in it
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e).with_context(|| format!("removing {}", path.display())),
            },
        }
    }
    Ok(())
}

/// The file name of the drop-ins `install-units` writes (in `shardd.service.d/`,
/// `shardd.socket.d/`).
const DROPIN: &str = "install-units.conf";

/// The directory systemd makes writable for the service (`CacheDirectory=shardd`).
const CACHE_DIRECTORY: &str = "/var/cache/shardd";

/// The user the service runs as: `DynamicUser=yes` without `User=` names it after the unit
/// (a static user of that name, when there is one, is used instead of a dynamic one).
const SERVICE_USER: &str = "shardd";

/// What the committed socket unit says (`ListenStream=`, `SocketMode=`, `SocketGroup=`).
const UNIT_SOCKET: &str = "/run/shardd/shardd.sock";
const UNIT_SOCKET_MODE: u32 = 0o660;
const UNIT_SOCKET_GROUP: &str = "shardd";

/// One drop-in for one unit: its text, or `None` when the config needs none (a stale one is
/// then removed); `why` says what in the config it is for.
#[derive(Debug, PartialEq, Eq)]
pub struct Dropin {
    pub dir: &'static str,
    pub text: Option<String>,
    pub why: String,
}

/// The drop-ins the committed units need to run with `config` (read from `source`):
///
/// - `shardd.service.d`: a `cache.dir` outside `/var/cache/shardd` (a persistent disk, a local
///   SSD). `ProtectSystem=strict` leaves only `CacheDirectory=` writable, so it adds
///   `ReadWritePaths=` for the directory, `RequiresMountsFor=` (the service waits for the
///   disk's mount, and never fills the boot disk under an unmounted mount point), and an
///   `ExecStartPre=+` (run as root, outside the sandbox) that creates it owned by the service's
///   user, mode 0700, at every start: a local SSD comes back empty after a stop or a
///   maintenance event.
/// - `shardd.socket.d`: `[server] socket`, `socket_mode` or `socket_group` other than the
///   socket unit's. Under socket activation systemd makes the socket, so these keys only
///   take effect through the unit.
pub fn dropins(config: &crate::config::Config, source: &Path) -> anyhow::Result<Vec<Dropin>> {
    let header = format!(
        "# Written by `shardd install-units --config {}`; run it again after changing the config.\n",
        source.display()
    );
    let cache = &config.cache_dir;
    let service = if cache.starts_with(CACHE_DIRECTORY) {
        Dropin {
            dir: "shardd.service.d",
            text: None,
            why: format!("cache.dir {} is in CacheDirectory=", cache.display()),
        }
    } else {
        let dir = unit_path(cache, "cache.dir")?;
        for hidden in ["/home", "/root", "/run/user", "/tmp", "/var/tmp"] {
            if cache.starts_with(hidden) {
                anyhow::bail!(
                    "cache.dir {dir} is under {hidden}, which the service does not see \
                     (ProtectHome=yes, PrivateTmp=yes): put the cache on a disk mounted \
                     elsewhere, e.g. /mnt/disks/ssd/shardd"
                );
            }
        }
        Dropin {
            dir: "shardd.service.d",
            text: Some(format!(
                "{header}# cache.dir is outside CacheDirectory= ({CACHE_DIRECTORY}), the only cache \
                 directory ProtectSystem=strict\n\
                 # leaves writable: made writable here, waited for (its mount), and created at \
                 every start\n\
                 # (a local SSD comes back empty) owned by the service's user.\n\
                 [Unit]\n\
                 RequiresMountsFor={dir}\n\
                 \n\
                 [Service]\n\
                 ExecStartPre=+/usr/bin/install -d -o {SERVICE_USER} -g {SERVICE_USER} -m 0700 {dir}\n\
                 ReadWritePaths={dir}\n"
            )),
            why: format!(
                "cache.dir {dir} is outside {CACHE_DIRECTORY}: the service may write it \
                 (ReadWritePaths=), waits for its mount and creates it at start"
            ),
        }
    };
    let mut socket_lines = String::new();
    let mut socket_why = Vec::new();
    if config.socket != Path::new(UNIT_SOCKET) {
        let path = unit_path(&config.socket, "server.socket")?;
        socket_lines += &format!("ListenStream=\nListenStream={path}\n");
        socket_why.push(format!("server.socket {path}"));
    }
    if config.socket_mode != UNIT_SOCKET_MODE {
        socket_lines += &format!("SocketMode={:04o}\n", config.socket_mode);
        socket_why.push(format!("server.socket_mode {:04o}", config.socket_mode));
    }
    if let Some(group) = config
        .socket_group
        .as_deref()
        .filter(|g| *g != UNIT_SOCKET_GROUP)
    {
        if !group
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c))
        {
            anyhow::bail!("server.socket_group {group:?} is not a group name or number");
        }
        socket_lines += &format!("SocketGroup={group}\n");
        socket_why.push(format!("server.socket_group {group}"));
    }
    let socket = if socket_lines.is_empty() {
        Dropin {
            dir: "shardd.socket.d",
            text: None,
            why: "the socket is the socket unit's".into(),
        }
    } else {
        Dropin {
            dir: "shardd.socket.d",
            text: Some(format!(
                "{header}# The socket as [server] says (systemd makes it: socket activation).\n\
                 [Socket]\n{socket_lines}"
            )),
            why: format!("the socket unit takes {}", socket_why.join(", ")),
        }
    };
    Ok(vec![service, socket])
}

/// `path` as it can stand in a unit file unquoted: absolute, and no character that systemd
/// would read as a separator, a quote, an escape or a specifier (`%`).
fn unit_path<'a>(path: &'a Path, key: &str) -> anyhow::Result<&'a str> {
    let text = path
        .to_str()
        .filter(|t| t.starts_with('/'))
        .ok_or_else(|| anyhow::anyhow!("{key} {} is not an absolute path", path.display()))?;
    if !text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+@,=:".contains(c))
    {
        anyhow::bail!(
            "{key} {text:?} holds characters a unit file would need quoted or escaped; \
             use a plain path (letters, digits, / . _ - + @ , = :)"
        );
    }
    Ok(text)
}

/// `shardd merge-config BASE OVERLAY... [-o OUT]`: the overlays' keys over the base's, table by
/// table ([`crate::config::merge_tables`]), validated as a config (offline) and written.
pub fn merge_config(
    base: &Path,
    overlays: &[PathBuf],
    output: Option<&Path>,
) -> anyhow::Result<()> {
    let read = |path: &Path| -> anyhow::Result<toml::Table> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read config {}", path.display()))?;
        Ok(crate::config::parse_table(&text, path)?)
    };
    let mut table = read(base)?;
    for overlay in overlays {
        crate::config::merge_tables(&mut table, read(overlay)?);
    }
    let names: Vec<String> = std::iter::once(base)
        .chain(overlays.iter().map(PathBuf::as_path))
        .map(|p| p.display().to_string())
        .collect();
    let text = format!(
        "# Written by `shardd merge-config {}`: the keys of each file over those of the one\n\
         # before, table by table. Change those files, not this one.\n\n{}",
        names.join(" "),
        toml::to_string(&table).context("writing the merged config")?
    );
    // Relative paths in it (local shards) then mean what they mean next to the output.
    let base_dir = output
        .and_then(Path::parent)
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    crate::config::Config::parse(&text, base_dir)
        .with_context(|| format!("the config merged from {} is invalid", names.join(" + ")))?;
    match output {
        Some(out) => {
            let dir = out
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            let name = out
                .file_name()
                .ok_or_else(|| anyhow::anyhow!("{} is not a file name", out.display()))?;
            write(dir, &name.to_string_lossy(), &text)?;
            println!("{}", out.display());
        }
        None => print!("{text}"),
    }
    Ok(())
}

fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("writing {name} into {}", dir.display()))?;
    tmp.write_all(text.as_bytes())?;
    tmp.as_file()
        .set_permissions(std::fs::Permissions::from_mode(0o644))?;
    tmp.persist(&path)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exec_start_runs_the_given_binary_and_nothing_else_changes() {
        let units = units(Path::new("/opt/venv/bin/shardd"));
        let (name, service) = &units[0];
        assert_eq!(*name, "shardd.service");
        assert!(
            service.contains(
                "\nExecStart=/opt/venv/bin/shardd serve --config /etc/shardd/config.toml\n"
            )
        );
        assert_eq!(
            service.replace("/opt/venv/bin/shardd serve", "/usr/local/bin/shardd serve"),
            UNITS[0].1
        );
        assert_eq!(units[1], ("shardd.socket", UNITS[1].1.to_string()));
    }

    #[test]
    fn installs_both_units_mode_0644() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        install(dir.path(), None).unwrap();
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["shardd.service", "shardd.socket"]);
        for name in names {
            let meta = std::fs::metadata(dir.path().join(name)).unwrap();
            assert_eq!(meta.permissions().mode() & 0o777, 0o644);
        }
    }
    fn config(extra: &str) -> crate::config::Config {
        let text = format!("{extra}\n[datasets.train]\nshards = \"/data/train-{{0..3}}.tar\"\n");
        crate::config::Config::parse(&text, Path::new("/etc/shardd")).unwrap()
    }

    fn dropin_texts(extra: &str) -> (Option<String>, Option<String>) {
        let d = dropins(&config(extra), Path::new("/etc/shardd/config.toml")).unwrap();
        assert_eq!(
            (d[0].dir, d[1].dir),
            ("shardd.service.d", "shardd.socket.d")
        );
        (d[0].text.clone(), d[1].text.clone())
    }

    #[test]
    fn the_default_config_needs_no_dropin() {
        assert_eq!(dropin_texts(""), (None, None));
        // A cache inside CacheDirectory= neither; the socket unit's own values neither.
        let same = "[server]\nsocket = \"/run/shardd/shardd.sock\"\nsocket_mode = \"0660\"\n\
                    socket_group = \"shardd\"\n[cache]\ndir = \"/var/cache/shardd/v2\"";
        assert_eq!(dropin_texts(same), (None, None));
    }

    #[test]
    fn a_cache_on_another_disk_gets_a_service_dropin() {
        let (service, socket) = dropin_texts("[cache]\ndir = \"/mnt/disks/ssd/shardd\"");
        assert_eq!(socket, None);
        let service = service.unwrap();
        assert!(
            service.starts_with(
                "# Written by `shardd install-units --config /etc/shardd/config.toml`"
            )
        );
        let body: Vec<&str> = service.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(
            body,
            [
                "[Unit]",
                "RequiresMountsFor=/mnt/disks/ssd/shardd",
                "",
                "[Service]",
                "ExecStartPre=+/usr/bin/install -d -o shardd -g shardd -m 0700 /mnt/disks/ssd/shardd",
                "ReadWritePaths=/mnt/disks/ssd/shardd",
            ]
        );
    }

    #[test]
    fn socket_keys_go_into_a_socket_dropin() {
        let (service, socket) = dropin_texts(
            "[server]\nsocket = \"/run/trainers/shardd.sock\"\nsocket_mode = \"0666\"\n\
             socket_group = \"trainers\"",
        );
        assert_eq!(service, None);
        let body: Vec<String> = socket
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .map(String::from)
            .collect();
        assert_eq!(
            body,
            [
                "[Socket]",
                "ListenStream=",
                "ListenStream=/run/trainers/shardd.sock",
                "SocketMode=0666",
                "SocketGroup=trainers"
            ]
        );
    }

    #[test]
    fn cache_dirs_the_service_cannot_use_are_refused_with_the_reason() {
        let refused = |dir: &str| {
            dropins(
                &config(&format!("[cache]\ndir = {dir:?}")),
                Path::new("c.toml"),
            )
            .unwrap_err()
            .to_string()
        };
        assert!(refused("/home/me/cache").contains("ProtectHome=yes"));
        assert!(refused("/tmp/cache").contains("PrivateTmp=yes"));
        assert!(refused("/mnt/my disk/cache").contains("quoted or escaped"));
        assert!(refused("/mnt/100%/cache").contains("quoted or escaped"));
        // A relative cache.dir is the config directory's: /etc/shardd/cache here.
        let relative = dropins(&config("[cache]\ndir = \"cache\""), Path::new("c.toml")).unwrap();
        assert!(
            relative[0].why.starts_with("cache.dir /etc/shardd/cache "),
            "{relative:?}"
        );
    }

    #[test]
    fn install_writes_the_dropins_and_removes_stale_ones() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("config.toml");
        let units = dir.path().join("units");
        std::fs::create_dir(&units).unwrap();
        let dataset = "[datasets.train]\nshards = \"/data/train-{0..3}.tar\"\n";
        std::fs::write(
            &conf,
            format!("[cache]\ndir = \"/mnt/disks/ssd/shardd\"\n[server]\nsocket_mode = \"0666\"\n{dataset}"),
        )
        .unwrap();
        install(&units, Some(&conf)).unwrap();
        let service = units.join("shardd.service.d").join(DROPIN);
        let socket = units.join("shardd.socket.d").join(DROPIN);
        assert!(
            std::fs::read_to_string(&service)
                .unwrap()
                .contains("ReadWritePaths=")
        );
        assert!(
            std::fs::read_to_string(&socket)
                .unwrap()
                .contains("SocketMode=0666")
        );
        // An operator's own drop-in beside it stays, and keeps its directory.
        std::fs::write(units.join("shardd.socket.d/operator.conf"), "[Socket]\n").unwrap();
        std::fs::write(&conf, dataset).unwrap();
        install(&units, Some(&conf)).unwrap();
        assert!(!service.exists() && !units.join("shardd.service.d").exists());
        assert!(!socket.exists() && units.join("shardd.socket.d/operator.conf").exists());
        // An invalid config writes nothing at all.
        std::fs::remove_file(units.join("shardd.service")).unwrap();
        std::fs::write(&conf, "[cache]\nbogus = 1\n").unwrap();
        assert!(install(&units, Some(&conf)).is_err());
        assert!(!units.join("shardd.service").exists());
    }

    #[test]
    fn merge_config_writes_a_valid_merge_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        std::fs::write(
            p("defaults.toml"),
            "[server]\nmetrics_addr = \"127.0.0.1:9464\"\n[cache]\ndir = \"/var/cache/shardd\"\n",
        )
        .unwrap();
        std::fs::write(
            p("metadata.toml"),
            "[cache]\nmax_size = \"1GiB\"\n[datasets.train]\nshards = \"shards/{0..3}.tar\"\n",
        )
        .unwrap();
        let out = p("config.toml");
        merge_config(&p("defaults.toml"), &[p("metadata.toml")], Some(&out)).unwrap();
        let text = std::fs::read_to_string(&out).unwrap();
        assert!(text.starts_with("# Written by `shardd merge-config "));
        let c = crate::config::Config::load(&out).unwrap();
        assert_eq!(c.cache_dir, PathBuf::from("/var/cache/shardd"));
        assert_eq!(c.metrics_addr, Some("127.0.0.1:9464".parse().unwrap()));
        // A relative shard path means the same next to the output as next to its source.
        assert_eq!(
            c.datasets["train"].shards[0].as_str(),
            p("shards/0.tar").to_str().unwrap()
        );
        // An invalid merge (here: a dataset without shards) leaves the output as it was.
        std::fs::write(p("bad.toml"), "[datasets.train]\nshards = []\n").unwrap();
        let e = merge_config(&p("defaults.toml"), &[p("bad.toml")], Some(&out)).unwrap_err();
        assert!(format!("{e:#}").contains("is invalid"), "{e:#}");
        assert_eq!(std::fs::read_to_string(&out).unwrap(), text);
    }
}
