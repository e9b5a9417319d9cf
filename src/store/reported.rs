//! What a store says about an object's content, read from its response headers.
//!
//! object_store parses ETag and size but not the checksum headers, so every store's HTTP
//! client is wrapped (`http.rs`): each successful response's headers are read into a
//! [`Reported`], which object_store hands back in `GetResult::extensions`. No extra request:
//! the headers come with every GET.
//! - **GCS** (`x-goog-hash: crc32c=…,md5=…`, base64, big-endian): every object has a CRC-32C,
//!   composite ones included; only non-composite ones have an MD5. A ranged GET reports the
//!   whole object's hashes.
//! - **S3**: an ETag is an MD5 only for an object uploaded in one part (no `-N`) and not
//!   encrypted with SSE-KMS or SSE-C, which the `x-amz-server-side-encryption` headers tell;
//!   a full-object `x-amz-checksum-crc32c` (sent when the upload carried one) is used too.

use base64::Engine;

/// The checksums a store reported for a whole object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reported {
    pub crc32c: Option<u32>,
    pub md5: Option<[u8; 16]>,
}

/// Which store's headers to read.
#[derive(Debug, Clone, Copy)]
pub enum Kind {
    Gcs,
    S3,
}

impl Reported {
    /// What a successful response's headers say about its object.
    pub fn from_headers(kind: Kind, headers: &reqwest::header::HeaderMap) -> Reported {
        match kind {
            Kind::Gcs => gcs(headers.get_all("x-goog-hash").iter().map(as_str)),
            Kind::S3 => s3(|name| headers.get(name).map(as_str)),
        }
    }
}

fn as_str(value: &impl AsRef<[u8]>) -> &str {
    std::str::from_utf8(value.as_ref()).unwrap_or("")
}

/// `x-goog-hash` values: `crc32c=<base64>` and `md5=<base64>`, in one header or several.
fn gcs<'a>(values: impl Iterator<Item = &'a str>) -> Reported {
    let mut reported = Reported::default();
    for item in values.flat_map(|v| v.split(',')) {
        match item.trim().split_once('=') {
            Some(("crc32c", b64)) => reported.crc32c = crc32c(b64),
            Some(("md5", b64)) => reported.md5 = decode::<16>(b64),
            _ => {}
        }
    }
    reported
}

/// S3's ETag as an MD5 where it is one, and a full-object CRC-32C if the store sent one.
fn s3<'a>(header: impl Fn(&str) -> Option<&'a str>) -> Reported {
    let encrypted = header("x-amz-server-side-encryption-customer-algorithm").is_some()
        || header("x-amz-server-side-encryption").is_some_and(|v| v.starts_with("aws:kms"));
    let md5 = header("etag")
        .map(|tag| tag.trim_start_matches("W/").trim_matches('"'))
        .filter(|tag| !encrypted && tag.len() == 32)
        .and_then(hex16);
    let composite = header("x-amz-checksum-type").is_some_and(|t| t == "COMPOSITE");
    let crc32c = header("x-amz-checksum-crc32c")
        .filter(|_| !composite)
        .and_then(crc32c);
    Reported { crc32c, md5 }
}

/// A CRC-32C as GCS and S3 write it: base64 of its 4 bytes, big-endian.
pub fn crc32c(b64: &str) -> Option<u32> {
    decode::<4>(b64).map(u32::from_be_bytes)
}

/// A CRC-32C written as GCS and S3 write it.
pub fn crc32c_text(crc: u32) -> String {
    base64::engine::general_purpose::STANDARD.encode(crc.to_be_bytes())
}

fn decode<const N: usize>(b64: &str) -> Option<[u8; N]> {
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .ok()?;
    raw.try_into().ok()
}

fn hex16(text: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    hex::decode_to_slice(text, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MD5: [u8; 16] = [
        0x76, 0x4e, 0xfa, 0x88, 0x3d, 0xda, 0x1e, 0x11, 0xdb, 0x47, 0x67, 0x1c, 0x4a, 0x3b, 0xbd,
        0x9e,
    ];

    #[test]
    fn gcs_reports_crc32c_always_and_md5_when_it_has_one() {
        let both = gcs(["crc32c=5+cEzA==,md5=dk76iD3aHhHbR2ccSju9ng=="].into_iter());
        assert_eq!(both.crc32c, Some(0xe7e7_04cc));
        assert_eq!(both.md5, Some(MD5));
        // A composite object: two headers, and no MD5.
        let composite = gcs(["crc32c=5+cEzA==", "junk"].into_iter());
        assert_eq!(
            composite,
            Reported {
                crc32c: Some(0xe7e7_04cc),
                md5: None
            }
        );
        assert_eq!(gcs(["crc32c=notbase64"].into_iter()), Reported::default());
        assert_eq!(crc32c_text(0xe7e7_04cc), "5+cEzA==");
    }

    #[test]
    fn an_s3_etag_is_an_md5_only_when_the_headers_say_so() {
        fn with(headers: &[(&str, &str)]) -> Reported {
            s3(|name| headers.iter().find(|(n, _)| *n == name).map(|(_, v)| *v))
        }
        let tag = ("etag", "\"764efa883dda1e11db47671c4a3bbd9e\"");
        assert_eq!(with(&[tag]).md5, Some(MD5));
        assert_eq!(
            with(&[tag, ("x-amz-server-side-encryption", "AES256")]).md5,
            Some(MD5)
        );
        for encrypted in [
            ("x-amz-server-side-encryption", "aws:kms"),
            ("x-amz-server-side-encryption", "aws:kms:dsse"),
            ("x-amz-server-side-encryption-customer-algorithm", "AES256"),
        ] {
            assert_eq!(with(&[tag, encrypted]).md5, None, "{encrypted:?}");
        }
        let multipart = ("etag", "\"764efa883dda1e11db47671c4a3bbd9e-3\"");
        assert_eq!(with(&[multipart]), Reported::default());
        let crc = ("x-amz-checksum-crc32c", "5+cEzA==");
        assert_eq!(with(&[multipart, crc]).crc32c, Some(0xe7e7_04cc));
        let composite = ("x-amz-checksum-type", "COMPOSITE");
        assert_eq!(with(&[multipart, crc, composite]).crc32c, None);
    }
}
