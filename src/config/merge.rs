//! Config files merged into one (`shardd merge-config`: a TPU VM's defaults and the config
//! in its metadata).

use std::path::Path;

use super::ConfigError;

/// A config file's text as a TOML table, not yet validated; errors name `path`.
pub fn parse_table(text: &str, path: &Path) -> Result<toml::Table, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError::Parse {
        path: path.into(),
        message: e.to_string(),
    })
}

/// Merges `overlay` into `base` table by table, at every depth: where both hold a table under
/// the same key, the two are merged the same way; any other value of `overlay` (a string, a
/// number, an array, an array of tables, or a table where `base` has something else) replaces
/// `base`'s. Keys only in `base` stay. So `[cache] max_size` over defaults that hold
/// `[cache] dir` gives a `[cache]` with both, the overlay's `max_size` winning.
pub fn merge_tables(base: &mut toml::Table, overlay: toml::Table) {
    for (key, value) in overlay {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge_tables(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use crate::config::Config;

    use super::*;

    fn merged(base: &str, overlay: &str) -> toml::Table {
        let mut b = parse_table(base, Path::new("base.toml")).unwrap();
        merge_tables(
            &mut b,
            parse_table(overlay, Path::new("overlay.toml")).unwrap(),
        );
        b
    }

    #[test]
    fn tables_merge_key_by_key_and_the_overlay_wins() {
        let m = merged(
            "[server]\nsocket = \"/run/shardd/shardd.sock\"\nmetrics_addr = \"127.0.0.1:9464\"\n\
             [cache]\ndir = \"/var/cache/shardd\"\n[host]\nindex = \"auto\"\ncount = \"auto\"\n",
            "[cache]\nmax_size = \"1GiB\"\n[server]\nmetrics_addr = \"0.0.0.0:9464\"\n\
             [datasets.train]\nshards = [\"/d/a.tar\", \"/d/b.tar\"]\n",
        );
        let expect: toml::Table = toml::from_str(
            "[server]\nsocket = \"/run/shardd/shardd.sock\"\nmetrics_addr = \"0.0.0.0:9464\"\n\
             [cache]\ndir = \"/var/cache/shardd\"\nmax_size = \"1GiB\"\n\
             [host]\nindex = \"auto\"\ncount = \"auto\"\n\
             [datasets.train]\nshards = [\"/d/a.tar\", \"/d/b.tar\"]\n",
        )
        .unwrap();
        assert_eq!(m, expect);
        // What it writes parses back to the same table, and is a valid config.
        let text = toml::to_string(&m).unwrap();
        assert_eq!(toml::from_str::<toml::Table>(&text).unwrap(), expect);
        let c = Config::parse(&text, Path::new("/etc/shardd")).unwrap();
        assert_eq!(c.cache_dir, PathBuf::from("/var/cache/shardd"));
        assert_eq!(c.metrics_addr, Some("0.0.0.0:9464".parse().unwrap()));
    }

    #[test]
    fn nested_tables_merge_and_other_values_replace() {
        let m = merged(
            "[datasets.train]\nshards = \"/a/{0..3}.tar\"\nshuffle_buffer = 5\n\
             [datasets.web]\nshards = [\"/w/0.tar\", \"/w/1.tar\"]\n\
             [datasets.mix]\nmix = { train = 1, web = 1 }\nsamples_per_epoch = 10\n",
            // An array replaces an array (not appended), a string an array, an inline table
            // merges into a table; an array of tables replaces whatever was there.
            "[datasets.train]\nshuffle_buffer = 7\n[datasets.web]\nshards = \"/w/{0..9}.tar\"\n\
             [datasets.mix]\nmix = { web = 3 }\nschedule = [{ epoch = 2, mix = { web = 1 } }]\n",
        );
        let d = m["datasets"].as_table().unwrap();
        assert_eq!(d["train"]["shards"].as_str(), Some("/a/{0..3}.tar"));
        assert_eq!(d["train"]["shuffle_buffer"].as_integer(), Some(7));
        assert_eq!(d["web"]["shards"].as_str(), Some("/w/{0..9}.tar"));
        assert_eq!(d["mix"]["mix"]["train"].as_integer(), Some(1));
        assert_eq!(d["mix"]["mix"]["web"].as_integer(), Some(3));
        assert_eq!(d["mix"]["schedule"].as_array().unwrap().len(), 1);
        // A duplicate key inside one file is still that file's error, naming it.
        let e = parse_table(
            "[cache]\ndir = \"/a\"\n[cache]\nmax_size = \"1GiB\"\n",
            Path::new("m.toml"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("invalid config m.toml: ") && e.contains("duplicate key"),
            "{e}"
        );
    }
}
