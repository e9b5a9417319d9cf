//! `shardd check`: `serve` without serving. Every condition that stops `serve` at start
//! fails `check` (exit 1) with the same message, and so does a shard it cannot read. Offline
//! (`--offline`) it asks no store and no metadata server, and still checks all that needs
//! neither: the config, the directories `serve` must write, the socket's group, and every
//! dataset whose shards and manifest are local files (reading a file asks no one); there a
//! missing shard is a warning, as it is to `serve`.

use std::path::Path;

use futures::StreamExt;

use crate::cmd::plan_report;
use crate::config::url::{Location, ShardUrl};
use crate::config::{Config, Dataset};
use crate::ops::error_line::one_line;
use crate::ops::progress;
use crate::store::Stores;

pub async fn run(path: &Path, reach_stores: bool) -> anyhow::Result<()> {
    let config = Config::load(path)?;
    let stores = Stores::from_config(&config, Default::default())?;
    println!("{}: ok", path.display());
    for w in crate::config::space::space_warnings(&config) {
        println!("warning: {w}");
    }
    let mut refused = 0usize;
    for e in local_errors(&config) {
        println!("error: {e}");
        refused += 1;
    }
    if reach_stores {
        stores.check_credentials().await?;
    }
    let mut missing_in_all = 0usize;
    for (name, d) in &config.datasets {
        println!(
            "dataset {name}: {} shards, first {}, last {}, shuffle_buffer {}",
            d.shards.len(),
            d.shards[0],
            d.shards[d.shards.len() - 1],
            d.shuffle_buffer
        );
        if !reach_stores && !is_local(d) {
            continue;
        }
        let missing = check_shards(&stores, name, &d.shards, config.max_downloads).await;
        if reach_stores {
            missing_in_all += missing;
        } else if missing > 0 {
            // Offline is what stops `serve`, and a missing shard does not: it starts, and
            // says so (a boot script checks offline before the shards are all there).
            println!(
                "warning: dataset {name}: {missing} shards cannot be read: `serve` starts, and streams of this dataset fail"
            );
        }
        match plan_report::check_working_set(&config, &stores, d).await {
            Ok((lines, warnings)) => {
                lines.iter().for_each(|l| println!("{l}"));
                warnings.iter().for_each(|w| println!("warning: {w}"));
            }
            // What stops `serve` (a manifest it cannot read, or that names other shards)
            // fails `check` too.
            Err(e) => {
                println!("error: {}", one_line(e.as_ref()));
                refused += 1;
            }
        }
    }
    if missing_in_all > 0 || refused > 0 {
        let mut why = Vec::new();
        if missing_in_all > 0 {
            why.push(format!("{missing_in_all} shards cannot be read"));
        }
        if refused > 0 {
            why.push(format!("{refused} problems would stop `shardd serve`"));
        }
        anyhow::bail!("{} (listed above)", why.join(", "));
    }
    Ok(())
}

/// Whether reading a dataset's shards and manifest asks no one but the local disk.
fn is_local(d: &Dataset) -> bool {
    let local = |u: &ShardUrl| matches!(u.location(), Location::Local(_));
    d.shards.iter().all(local) && d.manifest.as_ref().is_none_or(local)
}

/// What stops `serve` before it reads a shard and needs no store: the directories it must
/// write (`cache.dir`, `server.socket`'s), and `server.socket_group`.
fn local_errors(config: &Config) -> Vec<String> {
    let mut errors = Vec::new();
    let hint = "(a relative path is the config file's directory's)";
    if let Err(e) = writable(&config.cache_dir) {
        errors.push(format!(
            "cache.dir {}: {e}; set [cache] dir to a directory this user may write {hint}",
            config.cache_dir.display()
        ));
    }
    let socket_dir = config.socket.parent().unwrap_or(Path::new("."));
    if let Err(e) = writable(socket_dir) {
        errors.push(format!(
            "server.socket {}: {e}; set [server] socket to a path in a directory this user may write {hint}",
            config.socket.display()
        ));
    }
    if let Some(group) = &config.socket_group
        && let Err(e) = crate::serve::daemon::group_id(group)
    {
        errors.push(format!("server.socket_group: {e}"));
    }
    errors
}

/// Whether this user may make `dir` (if it is missing) and write in it: asks about the
/// directory, or else its nearest existing ancestor, as `create_dir_all` would meet it.
fn writable(dir: &Path) -> Result<(), String> {
    use rustix::fs::{Access, access};
    let uid = rustix::process::geteuid().as_raw();
    let mut at = dir;
    loop {
        match std::fs::metadata(at) {
            Ok(m) if !m.is_dir() => return Err(format!("{} is not a directory", at.display())),
            Ok(_) => {
                return access(at, Access::WRITE_OK | Access::EXEC_OK).map_err(|e| {
                    format!(
                        "{} is not writable by this user (uid {uid}): {}",
                        at.display(),
                        std::io::Error::from(e)
                    )
                });
            }
            Err(_) => match at.parent() {
                Some(parent) if !parent.as_os_str().is_empty() => at = parent,
                _ => return Ok(()),
            },
        }
    }
}

/// Asks the store for every shard of a dataset (HEAD or stat, `parallel` at a time, with
/// progress on stderr); prints the total, the largest shard and what cannot be read. Returns
/// how many cannot be read.
async fn check_shards(stores: &Stores, name: &str, shards: &[ShardUrl], parallel: usize) -> usize {
    let mut progress = progress::Progress::counting(name, shards.len() as u64, "found");
    let mut found = futures::stream::iter(shards.iter().cloned())
        .map(|s| async move { (stores.version(&s).await, s) })
        .buffered(parallel);
    let (mut bytes, mut largest, mut missing) = (0u64, None, Vec::new());
    while let Some((version, shard)) = found.next().await {
        match version {
            Ok(v) => {
                progress.add(v.size);
                bytes += v.size;
                if largest.as_ref().is_none_or(|(n, _)| v.size > *n) {
                    largest = Some((v.size, shard));
                }
            }
            Err(e) => {
                progress.add(0);
                missing.push(e.to_string());
            }
        }
    }
    progress.finish();
    if let Some((size, shard)) = largest {
        println!(
            "dataset {name}: {bytes} bytes in the store; the largest shard is {shard} ({size} bytes)"
        );
    }
    for m in missing.iter().take(10) {
        println!("dataset {name}: {m}");
    }
    if !missing.is_empty() {
        println!(
            "dataset {name}: {} of {} shards cannot be read",
            missing.len(),
            shards.len()
        );
    }
    missing.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_to_be_made_is_judged_by_its_nearest_ancestor() {
        let tmp = tempfile::tempdir().unwrap();
        assert_eq!(writable(&tmp.path().join("a/b/c")), Ok(()));
        let file = tmp.path().join("f");
        std::fs::write(&file, b"").unwrap();
        let err = writable(&file.join("cache")).unwrap_err();
        assert!(err.ends_with("f is not a directory"), "{err}");
    }
}
