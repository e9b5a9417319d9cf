//! `shardd install-units`: writes the systemd units of `deploy/systemd/`, which are built into
//! the binary, so that a host that installed shardd (the wheel, a copied binary) gets the units
//! of exactly that build, from nowhere else.

use std::path::{Path, PathBuf};

use anyhow::Context;

/// The units, as committed in `deploy/systemd/`.
const UNITS: [(&str, &str); 2] = [
    (
        "shardd.service",
        include_str!("../deploy/systemd/shardd.service"),
    ),
    (
        "shardd.socket",
        include_str!("../deploy/systemd/shardd.socket"),
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
/// `ExecStart` running this very binary. Prints the paths written.
pub fn install(dir: &Path) -> anyhow::Result<()> {
    let binary = std::env::current_exe()
        .and_then(|p| p.canonicalize())
        .context("finding this binary's path")?;
    for (name, text) in units(&binary) {
        let path = write(dir, name, &text)?;
        println!("{}", path.display());
    }
    Ok(())
}

fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<PathBuf> {
    use std::io::Write;
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(name);
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("writing a unit into {}", dir.display()))?;
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
        install(dir.path()).unwrap();
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
}
