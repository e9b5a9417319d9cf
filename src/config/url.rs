//! Shard URLs: where one shard lives. Below both `config` (which parses them) and `store`
//! (which reads them), so neither imports the other.
//!
//! Object names are taken verbatim: `gs://b/x~1 [a]=%.tar` names the object `x~1 [a]=%.tar`,
//! exactly as written (object_store's `Path::from` would percent-encode `%` and friends into
//! another name; `Path::parse` keeps it). A name the stores cannot address (an empty segment
//! as in `a//b`, a `.` or `..` segment, a control character, a trailing `/`) is refused when
//! the config is loaded, naming it.

use std::path::{Path, PathBuf};

use object_store::path::Path as ObjectPath;

#[derive(Debug, thiserror::Error)]
pub enum UrlError {
    #[error("{url}: unsupported scheme {scheme:?} (use gs://, s3://, file:// or a local path)")]
    Scheme { url: String, scheme: String },
    #[error("{url}: no bucket name")]
    NoBucket { url: String },
    #[error("{url}: no object path after the bucket")]
    NoObject { url: String },
    #[error(
        "{url}: the object name {name:?} cannot be addressed as written (empty, \".\" or \"..\" segment, control character, or a leading or trailing \"/\")"
    )]
    ObjectName { url: String, name: String },
    #[error("{url}: not a valid file:// URL")]
    FileUrl { url: String },
    #[error(
        "{url}: a {scheme}:// URL needs two slashes: did you mean {fixed:?}? (a local path that starts with \"{scheme}:\" is written \"./{url}\")"
    )]
    Slashes {
        url: String,
        scheme: String,
        fixed: String,
    },
}

/// One shard's location. `as_str()` is the URL trainers see as `__url__`, and the key the
/// cache files it under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ShardUrl {
    url: String,
    location: Location,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Location {
    Gcs { bucket: String, path: ObjectPath },
    S3 { bucket: String, path: ObjectPath },
    Local(PathBuf),
}

impl ShardUrl {
    /// Parses one expanded shard URL. A relative local path is resolved against `base_dir`.
    pub fn parse(url: &str, base_dir: &Path) -> Result<ShardUrl, UrlError> {
        let location = match url.split_once("://") {
            Some(("gs", rest)) => {
                let (bucket, path) = bucket_and_path(url, rest)?;
                Location::Gcs { bucket, path }
            }
            Some(("s3", rest)) => {
                let (bucket, path) = bucket_and_path(url, rest)?;
                Location::S3 { bucket, path }
            }
            Some(("file", _)) => file_url(url)?,
            Some((scheme, _)) => {
                return Err(UrlError::Scheme {
                    url: url.into(),
                    scheme: scheme.into(),
                });
            }
            None => {
                // `gs:/b/x` is a typo, not a local directory named "gs:"; `file:/data/x.tar`
                // is a file URL (RFC 8089's short form).
                if url.starts_with("file:/") {
                    return Ok(ShardUrl {
                        url: url.to_string(),
                        location: file_url(url)?,
                    });
                }
                if let Some((scheme @ ("gs" | "s3"), rest)) = url.split_once(':') {
                    return Err(UrlError::Slashes {
                        url: url.into(),
                        scheme: scheme.into(),
                        fixed: format!("{scheme}://{}", rest.trim_start_matches('/')),
                    });
                }
                let path = base_dir.join(url);
                return Ok(ShardUrl {
                    url: path.to_string_lossy().into_owned(),
                    location: Location::Local(path),
                });
            }
        };
        Ok(ShardUrl {
            url: url.to_string(),
            location,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.url
    }

    pub fn location(&self) -> &Location {
        &self.location
    }
}

impl std::fmt::Display for ShardUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

fn file_url(url: &str) -> Result<Location, UrlError> {
    let parsed = url::Url::parse(url).map_err(|_| UrlError::FileUrl { url: url.into() })?;
    let path = parsed
        .to_file_path()
        .map_err(|_| UrlError::FileUrl { url: url.into() })?;
    Ok(Location::Local(path))
}

fn bucket_and_path(url: &str, rest: &str) -> Result<(String, ObjectPath), UrlError> {
    let (bucket, name) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(UrlError::NoBucket { url: url.into() });
    }
    if name.is_empty() {
        return Err(UrlError::NoObject { url: url.into() });
    }
    // `parse` strips a leading or trailing '/', which would name another object: only a
    // name that survives unchanged is addressable as written.
    match ObjectPath::parse(name) {
        Ok(path) if path.as_ref() == name => Ok((bucket.to_string(), path)),
        _ => Err(UrlError::ObjectName {
            url: url.into(),
            name: name.into(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_schemes() {
        let base = Path::new("/etc/shardd");
        let g = ShardUrl::parse("gs://bkt/a/b-0.tar", base).unwrap();
        assert_eq!(
            g.location(),
            &Location::Gcs {
                bucket: "bkt".into(),
                path: ObjectPath::parse("a/b-0.tar").unwrap()
            }
        );
        let f = ShardUrl::parse("file:///data/x.tar", base).unwrap();
        assert_eq!(f.location(), &Location::Local("/data/x.tar".into()));
        let rel = ShardUrl::parse("data/x.tar", base).unwrap();
        assert_eq!(rel.as_str(), "/etc/shardd/data/x.tar");
        let abs = ShardUrl::parse("/data/x.tar", base).unwrap();
        assert_eq!(abs.as_str(), "/data/x.tar");
    }

    #[test]
    fn object_names_are_verbatim() {
        let base = Path::new("/");
        for name in [
            "x~1.tar",
            "a%20b.tar",
            "p#q.tar",
            "[x].tar",
            "a b=c.tar",
            "d/é~%.tar",
        ] {
            let url = format!("gs://bkt/{name}");
            let Location::Gcs { path, .. } = ShardUrl::parse(&url, base).unwrap().location else {
                panic!("{url}: not gcs");
            };
            assert_eq!(path.as_ref(), name, "{url}");
        }
        for name in [
            "a//b.tar",
            "./x.tar",
            "a/../b.tar",
            "x/",
            "/x.tar",
            "a\u{1}.tar",
        ] {
            let url = format!("s3://bkt/{name}");
            let err = ShardUrl::parse(&url, base).unwrap_err().to_string();
            assert!(
                err.contains("cannot be addressed as written"),
                "{url}: {err}"
            );
            assert!(err.starts_with(&url), "{err}");
        }
    }

    #[test]
    fn rejects_bad_urls() {
        let base = Path::new("/");
        let err = ShardUrl::parse("http://x/y.tar", base)
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsupported scheme \"http\""), "{err}");
        for (typo, fixed) in [
            ("gs:/bkt/x.tar", "gs://bkt/x.tar"),
            ("s3:bkt/x.tar", "s3://bkt/x.tar"),
        ] {
            let err = ShardUrl::parse(typo, base).unwrap_err().to_string();
            assert!(err.contains(&format!("did you mean {fixed:?}?")), "{err}");
        }
        // Only those two: a local name with another colon is a path...
        assert!(ShardUrl::parse("c:/x.tar", base).is_ok());
        // ...and `file:/path` is a file URL.
        let short = ShardUrl::parse("file:/data/x.tar", base).unwrap();
        assert_eq!(short.location(), &Location::Local("/data/x.tar".into()));
        assert!(matches!(
            ShardUrl::parse("gs:///y.tar", base),
            Err(UrlError::NoBucket { .. })
        ));
        assert!(matches!(
            ShardUrl::parse("gs://bkt", base),
            Err(UrlError::NoObject { .. })
        ));
    }
}
