//! Checking a download against the checksums its source vouches for (`store.verify`).
//!
//! The download computes the CRC-32C of what it wrote as it writes ([`super::download`]), so
//! a check costs no second pass over the bytes. What it is checked against, strongest first:
//! 1. the CRC-32C the store reports (GCS: every object, composite ones included; S3: when
//!    the upload carried a full-object one), see [`super::reported`];
//! 2. the CRC-32C the dataset's manifest recorded (`shardd index`) for this very version
//!    (same size, ETag and generation): it covers S3 multipart uploads and local files;
//! 3. an MD5 the store vouches for (an S3 object uploaded in one part, not under SSE-KMS or
//!    SSE-C), when the object came in one GET.
//!
//! With none of these, `"auto"` accepts the size (and the ETag pin of every ranged GET), and
//! `"checksum"` refuses the download. Local copies are checked by their size, inode and mtime
//! ([`super::local`]) and count as verified; a manifest's CRC-32C is checked on them too.

use std::collections::HashMap;

use super::reported::{Reported, crc32c_text};
use super::{ReadError, Stores, Version};
use crate::config::Verify;
use crate::config::url::ShardUrl;

/// What a download computed over the bytes it wrote.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub crc32c: u32,
    /// Only when the store's MD5 was the checksum to check.
    pub md5: Option<[u8; 16]>,
}

/// A read that passed its checks: the CRC-32C of the bytes (which the cache records), and
/// what they were checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetched {
    pub crc32c: u32,
    pub checked: Checked,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checked {
    /// The store's CRC-32C.
    StoreCrc32c,
    /// The manifest's CRC-32C (the store gave none).
    ManifestCrc32c,
    /// The store's MD5.
    StoreMd5,
    /// A local copy: its size, inode and mtime.
    Local,
    /// The size only: the source vouches for no checksum, or `store.verify = "size"`.
    Size,
}

/// The CRC-32C a manifest recorded for each shard, with the version it recorded it for.
pub(super) type Indexed = HashMap<String, (Version, u32)>;

impl Stores {
    /// Remembers the CRC-32C a manifest recorded for these shards: a download of the same
    /// version is checked against it.
    pub fn know_crc32c<'a>(&self, entries: impl IntoIterator<Item = (&'a str, &'a Version, u32)>) {
        let mut indexed = self.indexed.write().unwrap();
        for (url, version, crc) in entries {
            indexed.insert(url.to_string(), (version.clone(), crc));
        }
    }

    fn indexed_crc32c(&self, shard: &ShardUrl, version: &Version) -> Option<u32> {
        let indexed = self.indexed.read().unwrap();
        let (then, crc) = indexed.get(shard.as_str())?;
        (then == version).then_some(*crc)
    }

    /// Whether a one-part download should compute an MD5: only when that is the one checksum
    /// there is to check (an MD5 costs ~40 times a CRC-32C).
    pub(super) fn wants_md5(
        &self,
        shard: &ShardUrl,
        version: &Version,
        reported: Option<&Reported>,
    ) -> bool {
        let reported = reported.copied().unwrap_or_default();
        self.verify != Verify::Size
            && reported.md5.is_some()
            && reported.crc32c.is_none()
            && self.indexed_crc32c(shard, version).is_none()
    }

    /// Checks what a read received against every checksum its source vouches for.
    pub(super) fn verify(
        &self,
        shard: &ShardUrl,
        version: &Version,
        received: Received,
        reported: Option<Reported>,
        local: bool,
    ) -> Result<Fetched, ReadError> {
        let fetched = |checked| Fetched {
            crc32c: received.crc32c,
            checked,
        };
        if self.verify == Verify::Size {
            return Ok(fetched(if local { Checked::Local } else { Checked::Size }));
        }
        let reported = reported.unwrap_or_default();
        let mismatch = |what: String| ReadError::Checksum {
            url: shard.to_string(),
            what,
        };
        let crc = |who: &str, want: u32| {
            format!(
                "{who} says CRC-32C {}, the {} bytes received have CRC-32C {}",
                crc32c_text(want),
                version.size,
                crc32c_text(received.crc32c)
            )
        };
        let mut checked = if local { Checked::Local } else { Checked::Size };
        if let Some(want) = reported.crc32c {
            if want != received.crc32c {
                return Err(mismatch(crc("the store", want)));
            }
            checked = Checked::StoreCrc32c;
        }
        if let Some(want) = self.indexed_crc32c(shard, version) {
            if want != received.crc32c {
                return Err(mismatch(crc("the manifest", want)));
            }
            if checked != Checked::StoreCrc32c {
                checked = Checked::ManifestCrc32c;
            }
        }
        if let (Checked::Size, Some(want), Some(got)) = (checked, reported.md5, received.md5) {
            if want != got {
                return Err(mismatch(format!(
                    "the store says MD5 {}, the {} bytes received hash to {}",
                    hex::encode(want),
                    version.size,
                    hex::encode(got)
                )));
            }
            checked = Checked::StoreMd5;
        }
        if checked == Checked::Size && self.verify == Verify::Checksum {
            return Err(ReadError::Unverified {
                url: shard.to_string(),
            });
        }
        Ok(fetched(checked))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn stores(verify: &str) -> Stores {
        let text = format!("[store]\nverify = \"{verify}\"\n[datasets.d]\nshards = \"/d/a.tar\"");
        let config = Config::parse(&text, std::path::Path::new("/")).unwrap();
        Stores::from_config(&config, Default::default()).unwrap()
    }

    fn url() -> ShardUrl {
        ShardUrl::parse("gs://b/a.tar", std::path::Path::new("/")).unwrap()
    }

    fn version(tag: &str) -> Version {
        Version {
            size: 9,
            e_tag: Some(tag.into()),
            generation: None,
        }
    }

    const CRC: u32 = 0xE306_9283; // of "123456789"

    fn received(crc32c: u32, md5: Option<[u8; 16]>) -> Received {
        Received { crc32c, md5 }
    }

    fn reported(crc32c: Option<u32>, md5: Option<[u8; 16]>) -> Option<Reported> {
        Some(Reported { crc32c, md5 })
    }

    #[test]
    fn the_strongest_checksum_there_is_decides() {
        let s = stores("auto");
        let (u, v) = (url(), version("x"));
        let check = |rec, rep, local| s.verify(&u, &v, rec, rep, local).map(|f| f.checked);
        let by_store = check(received(CRC, None), reported(Some(CRC), None), false);
        assert_eq!(by_store.unwrap(), Checked::StoreCrc32c);
        let e = check(received(CRC ^ 1, None), reported(Some(CRC), None), false);
        assert_eq!(
            e.unwrap_err().to_string(),
            "gs://b/a.tar: checksum mismatch: the store says CRC-32C 4waSgw==, the 9 bytes received have CRC-32C 4waSgg=="
        );
        let md5 = Some([7u8; 16]);
        let by_md5 = check(received(CRC, md5), reported(None, md5), false);
        assert_eq!(by_md5.unwrap(), Checked::StoreMd5);
        let e = check(received(CRC, Some([8u8; 16])), reported(None, md5), false);
        assert!(e.unwrap_err().to_string().ends_with(
            "the store says MD5 07070707070707070707070707070707, the 9 bytes received hash to 08080808080808080808080808080808"
        ));
        assert_eq!(
            check(received(CRC, None), None, false).unwrap(),
            Checked::Size
        );
        assert_eq!(
            check(received(CRC, None), None, true).unwrap(),
            Checked::Local
        );

        // A manifest's CRC-32C, for this version only.
        s.know_crc32c([("gs://b/a.tar", &v, CRC)]);
        assert_eq!(
            check(received(CRC, None), None, false).unwrap(),
            Checked::ManifestCrc32c
        );
        let e = check(received(CRC ^ 1, None), None, true).unwrap_err();
        assert!(
            e.to_string().contains("the manifest says CRC-32C 4waSgw=="),
            "{e}"
        );
        let other = version("y");
        let stale = s.verify(&u, &other, received(CRC ^ 1, None), None, false);
        assert_eq!(stale.unwrap().checked, Checked::Size);
    }

    #[test]
    fn checksum_requires_one_and_size_checks_none() {
        let (u, v) = (url(), version("x"));
        let strict = stores("checksum");
        let e = strict.verify(&u, &v, received(CRC, None), None, false);
        assert!(matches!(e, Err(ReadError::Unverified { .. })));
        assert!(
            strict
                .verify(&u, &v, received(CRC, None), None, true)
                .is_ok()
        );
        let size = stores("size");
        let lying = size.verify(
            &u,
            &v,
            received(CRC ^ 1, None),
            reported(Some(CRC), None),
            false,
        );
        assert_eq!(lying.unwrap().checked, Checked::Size);
        assert!(!size.wants_md5(&u, &v, reported(None, Some([7u8; 16])).as_ref()));
        assert!(strict.wants_md5(&u, &v, reported(None, Some([7u8; 16])).as_ref()));
        assert!(!strict.wants_md5(&u, &v, reported(Some(CRC), Some([7u8; 16])).as_ref()));
    }
}
