//! Tar bytes → WebDataset samples, following webdataset's own rules (`tariterators.py`):
//! - only regular files are members; directories, links and the like are skipped;
//! - `__meta__`-style names (`__[^/]*__` as the first path component) are skipped;
//! - key = the path up to the first dot of the file name, field = the rest, lowercased
//!   (`a.b/c.seg.PNG` → key `a.b/c`, field `seg.png`); a name without such a dot is skipped;
//! - consecutive members with the same key form one sample; a sample never spans shards;
//! - the same field twice in one sample is an error.
//!
//! Field data are slices of the shard's bytes ([`ShardBytes`]): nothing is copied.

pub mod manifest;
pub mod sample_index;

use std::borrow::Cow;
use std::io;
use std::sync::Arc;

use crate::cache::ShardBytes;

#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("{url}: not a valid tar file: {source}")]
    Tar { url: String, source: std::io::Error },
    #[error("{url}: truncated: member {member:?} needs bytes up to {needed}, the shard has {len}")]
    Truncated {
        url: String,
        member: String,
        needed: u64,
        len: usize,
    },
    #[error("{url}: member {member:?}: duplicate field {field:?} in sample {key:?}")]
    DuplicateField {
        url: String,
        member: String,
        key: String,
        field: String,
    },
    #[error("{url}: member {member:?} is a sparse file, which shardd does not read")]
    Sparse { url: String, member: String },
    #[error("{url}: empty file, not a tar")]
    Empty { url: String },
    #[error("{url}: sample {key:?} has more than {MAX_FIELDS} fields")]
    TooManyFields { url: String, key: String },
}

/// Fields per sample the wire protocol can carry (a u16 count).
pub const MAX_FIELDS: usize = u16::MAX as usize;

/// One WebDataset sample: its key and its fields in tar order.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub key: Key,
    /// The shard URL, shared by all samples of the shard (`__url__`).
    pub url: Arc<str>,
    pub fields: Vec<(Arc<str>, ShardBytes)>,
}

/// A sample's key: valid UTF-8, and where the tar spells it in one piece (nearly always), a
/// slice of the shard's own bytes: no allocation per sample, and the sink can hand it to the
/// kernel by reference like the field data.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Key(ShardBytes);

impl Key {
    /// The key spelled at `range` of `data` (which must be UTF-8 there: what an index of
    /// `data`'s parse recorded).
    pub fn slice_of(data: &ShardBytes, range: std::ops::Range<usize>) -> Key {
        debug_assert!(std::str::from_utf8(&data[range.clone()]).is_ok());
        Key(data.slice(range))
    }

    /// The key's bytes (UTF-8), as the wire carries them.
    pub fn bytes(&self) -> &ShardBytes {
        &self.0
    }

    pub fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).expect("a Key is made of UTF-8 only")
    }
}

impl std::ops::Deref for Key {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<&str> for Key {
    fn from(key: &str) -> Key {
        Key(ShardBytes::heap(bytes::Bytes::copy_from_slice(
            key.as_bytes(),
        )))
    }
}

impl From<String> for Key {
    fn from(key: String) -> Key {
        Key(ShardBytes::heap(bytes::Bytes::from(key)))
    }
}

impl PartialEq<str> for Key {
    fn eq(&self, other: &str) -> bool {
        self.0[..] == *other.as_bytes()
    }
}

impl PartialEq<String> for Key {
    fn eq(&self, other: &String) -> bool {
        self.0[..] == *other.as_bytes()
    }
}

impl PartialEq<&str> for Key {
    fn eq(&self, other: &&str) -> bool {
        self.0[..] == *other.as_bytes()
    }
}

impl Sample {
    /// Bytes of payload (key and field data) this sample puts on the wire.
    pub fn payload_len(&self) -> usize {
        self.key.bytes().len() + self.fields.iter().map(|(_, d)| d.len()).sum::<usize>()
    }
}

/// Splits a tar's bytes into samples, in shard order.
pub fn parse(data: &ShardBytes, url: &Arc<str>) -> Result<Vec<Sample>, ShardError> {
    let mut samples: Vec<Sample> = Vec::new();
    // Field names repeat in every sample: share one allocation per distinct name.
    let mut names: Vec<Arc<str>> = Vec::new();
    if data.is_empty() {
        return Err(ShardError::Empty {
            url: url.to_string(),
        });
    }
    for member in Members::new(data) {
        let member = member.map_err(|e| match e {
            MemberError::Invalid(source) => ShardError::Tar {
                url: url.to_string(),
                source,
            },
            MemberError::Truncated { member, needed } => ShardError::Truncated {
                url: url.to_string(),
                member,
                needed,
                len: data.len(),
            },
        })?;
        let name = String::from_utf8_lossy(&member.path);
        if member.kind.is_gnu_sparse() {
            return Err(ShardError::Sparse {
                url: url.to_string(),
                member: name.into_owned(),
            });
        }
        if !(member.kind.is_file() || member.kind.is_contiguous()) || is_meta(&name) {
            continue;
        }
        let Some((key, field)) = split_name(&name) else {
            continue;
        };
        // Field names repeat in every sample: look the name up before lowercasing (which
        // allocates) when it has nothing to lowercase.
        let lowered;
        let field: &str = if field
            .bytes()
            .any(|b| !b.is_ascii() || b.is_ascii_uppercase())
        {
            lowered = field.to_lowercase();
            &lowered
        } else {
            field
        };
        let field_name = match names.iter().find(|n| ***n == *field) {
            Some(n) => n.clone(),
            None => {
                names.push(Arc::from(field));
                names.last().unwrap().clone()
            }
        };
        let body = data.slice(member.start..member.start + member.size);
        match samples.last_mut() {
            Some(s) if s.key == key => {
                if s.fields.len() == MAX_FIELDS {
                    return Err(ShardError::TooManyFields {
                        url: url.to_string(),
                        key: key.to_string(),
                    });
                }
                if s.fields.iter().any(|(n, _)| *n == field_name) {
                    return Err(ShardError::DuplicateField {
                        url: url.to_string(),
                        key: key.to_string(),
                        field: field.to_string(),
                        member: name.into_owned(),
                    });
                }
                s.fields.push((field_name, body));
            }
            _ => {
                // The key is a slice of the shard when the member's path is (valid UTF-8, not
                // joined from a ustar prefix): the common case allocates nothing.
                let key = match (&member.path, &name) {
                    (Cow::Borrowed(path), Cow::Borrowed(_)) => {
                        let at = path.as_ptr() as usize - data.as_ptr() as usize;
                        Key(data.slice(at..at + key.len()))
                    }
                    _ => Key::from(key),
                };
                samples.push(Sample {
                    key,
                    url: url.clone(),
                    fields: vec![(field_name, body)],
                })
            }
        }
    }
    Ok(samples)
}

/// One tar member: its full path (after GNU long-name and PAX records), type, and where its
/// data sits in the shard.
struct Member<'a> {
    path: Cow<'a, [u8]>,
    kind: tar::EntryType,
    start: usize,
    size: usize,
}

/// Walks the 512-byte blocks of a tar held in memory, with the `tar` crate's header types.
/// `tar::Archive` would copy every header and PAX record through `Read` and allocate for
/// each; reading in place halves the daemon's cost per small sample.
struct Members<'a> {
    data: &'a [u8],
    pos: usize,
    done: bool,
}

impl<'a> Members<'a> {
    fn new(data: &'a [u8]) -> Self {
        Members {
            data,
            pos: 0,
            done: false,
        }
    }

    fn next_member(&mut self) -> Result<Option<Member<'a>>, MemberError> {
        let (mut long_name, mut pax_path, mut pax_size) = (None, None, None);
        loop {
            let rest = &self.data[self.pos..];
            if rest.is_empty() {
                return Ok(None); // no end-of-archive blocks: tolerated, as tar and tarfile do
            }
            if rest.len() < BLOCK {
                return Err(bad("the archive ends inside a header block").into());
            }
            let block = &rest[..BLOCK];
            if block.iter().all(|b| *b == 0) {
                return Ok(None);
            }
            let header = tar::Header::from_byte_slice(block);
            if !checksum_matches(block, header.cksum()?) {
                return Err(bad("archive header checksum mismatch").into());
            }
            let kind = header.entry_type();
            // PAX records describe the next member, not an extension header in between (as in
            // tarfile and the tar crate): `x` (size) then `L` (long name) then the file.
            let extension = kind.is_gnu_longname()
                || kind.is_gnu_longlink()
                || kind.is_pax_local_extensions()
                || kind.is_pax_global_extensions();
            let size = match pax_size.filter(|_| !extension) {
                Some(size) => size,
                None => header.entry_size()?,
            };
            let start = self.pos + BLOCK;
            let path = match pax_path.or(long_name) {
                Some(p) => Cow::Borrowed(p),
                None => header.path_bytes(),
            };
            // Sizes come from the shard: check them before any arithmetic with them.
            let available = (self.data.len() - start) as u64;
            if size > available {
                return Err(MemberError::Truncated {
                    member: String::from_utf8_lossy(&path).into_owned(),
                    needed: start as u64 + size.min(u64::MAX - start as u64),
                });
            }
            let size = size as usize;
            self.pos = (start + size.next_multiple_of(BLOCK)).min(self.data.len());
            let body = &self.data[start..start + size];
            if kind.is_gnu_longname() {
                long_name = Some(&body[..body.iter().position(|b| *b == 0).unwrap_or(body.len())]);
            } else if kind.is_pax_local_extensions() {
                for record in PaxRecords(body) {
                    match record? {
                        (b"path", value) => pax_path = Some(value),
                        (b"size", value) => {
                            let digits = !value.is_empty() && value.iter().all(u8::is_ascii_digit);
                            pax_size = std::str::from_utf8(value)
                                .ok()
                                .filter(|_| digits)
                                .and_then(|v| v.parse().ok());
                            if pax_size.is_none() {
                                return Err(bad("invalid PAX size record").into());
                            }
                        }
                        _ => {}
                    }
                }
            } else if kind.is_gnu_longlink() || kind.is_pax_global_extensions() {
                // Link targets and archive-wide records say nothing about samples.
            } else {
                return Ok(Some(Member {
                    path,
                    kind,
                    start,
                    size,
                }));
            }
        }
    }
}

/// The records of a PAX extended header, `"%d %s=%s\n"`, read by their length as tarfile
/// does, so a value may hold newlines (the `tar` crate splits at newlines and refused such a
/// path). Like tarfile, the records end at the first bytes that do not start one (`\d+ `),
/// such as padding. Stricter than tarfile: a record that runs past the data, or lacks its
/// `=` or final newline, is an error rather than a guess. Linear in the data.
struct PaxRecords<'a>(&'a [u8]);

impl<'a> Iterator for PaxRecords<'a> {
    type Item = io::Result<(&'a [u8], &'a [u8])>;

    fn next(&mut self) -> Option<Self::Item> {
        let rest = self.0;
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || rest.get(digits) != Some(&b' ') {
            return None;
        }
        self.0 = &[]; // an error ends the records
        let len = std::str::from_utf8(&rest[..digits])
            .ok()
            .and_then(|d| d.parse::<usize>().ok())
            .filter(|len| (digits + 2..=rest.len()).contains(len));
        let Some(len) = len else {
            return Some(Err(bad("a PAX record's length does not fit its header")));
        };
        let record = &rest[digits + 1..len];
        let (Some(eq), Some(b'\n')) = (record.iter().position(|b| *b == b'='), record.last())
        else {
            return Some(Err(bad("malformed PAX record")));
        };
        self.0 = &rest[len..];
        Some(Ok((&record[..eq], &record[eq + 1..record.len() - 1])))
    }
}

/// Why walking a tar stopped.
enum MemberError {
    Invalid(io::Error),
    /// A member's data runs past the end of the shard.
    Truncated {
        member: String,
        needed: u64,
    },
}

impl From<io::Error> for MemberError {
    fn from(e: io::Error) -> Self {
        MemberError::Invalid(e)
    }
}

impl<'a> Iterator for Members<'a> {
    type Item = Result<Member<'a>, MemberError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.done {
            return None;
        }
        let next = self.next_member().transpose();
        self.done = !matches!(next, Some(Ok(_)));
        next
    }
}

const BLOCK: usize = 512;

/// A header's checksum: the sum of its bytes with the checksum field counted as spaces.
/// Some tars (Sun, NeXT) sum the bytes as signed chars, which differs once a name has bytes
/// of 0x80 and up; Python's `tarfile` (hence webdataset) accepts either sum, and so do we.
fn checksum_matches(block: &[u8], stored: u32) -> bool {
    // Summed apart (no iterator chain) so that the loops vectorize: this runs for every
    // member of every shard read.
    let (head, tail) = (&block[..148], &block[156..]);
    let unsigned = |b: &[u8]| b.iter().map(|&x| x as u32).sum::<u32>() as i64;
    if stored as i64 == 8 * 32 + unsigned(head) + unsigned(tail) {
        return true;
    }
    let signed = |b: &[u8]| b.iter().map(|&x| x as i8 as i32).sum::<i32>() as i64;
    stored as i64 == 8 * 32 + signed(head) + signed(tail)
}

fn bad(msg: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.to_string())
}

/// webdataset's metadata filter: a first path component like `__meta__` (or a top-level
/// name starting and ending with `__`) is not sample data. Its regex, `__[^/]*__($|/)`, is
/// Python's, whose `$` also matches before a final newline.
fn is_meta(name: &str) -> bool {
    match name.split_once('/') {
        None => {
            (name.starts_with("__") && name.ends_with("__"))
                || (name.len() >= 5 && name.starts_with("__") && name.ends_with("__\n"))
        }
        Some((first, _)) => first.len() >= 4 && first.starts_with("__") && first.ends_with("__"),
    }
}

/// webdataset's `base_plus_ext`, i.e. the Python regex `^((?:.*/|)[^.]+)[.]([^/]*)$`, without
/// a regex. The field follows the first dot after the last `/`. The key before it is `.*/`
/// then `[^.]+`: the regex tries `.*/` longest first (ending after a `/` before any newline,
/// since `.` does not match one), then empty, and the part after it may hold no dot. So a key
/// is usually everything up to the file name's first dot, and a file name starting with a dot
/// takes its directory into the key. Linear in the name (names can be 64 KiB PAX paths).
fn split_name(name: &str) -> Option<(&str, &str)> {
    let file = name.rfind('/').map_or(0, |i| i + 1);
    let dot = file + name[file..].find('.')?;
    let dir_dot = name[..file].rfind('.');
    let first_line = &name[..name.find('\n').unwrap_or(name.len())];
    let starts = first_line.rmatch_indices('/').map(|(i, _)| i + 1);
    for start in starts.chain(std::iter::once(0)) {
        if dir_dot.is_some_and(|d| start <= d) {
            return None; // `[^.]+` would have to cross that dot, here and for every shorter `.*/`
        }
        if dot > start {
            return Some((&name[..dot], &name[dot + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;

    fn tar_of(members: &[(&str, &[u8])]) -> ShardBytes {
        let mut b = tar::Builder::new(Vec::new());
        for (name, data) in members {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            h.set_entry_type(tar::EntryType::Regular);
            // append_data writes GNU long-name records for names over 100 bytes.
            b.append_data(&mut h, name, *data).unwrap();
        }
        ShardBytes::heap(Bytes::from(b.into_inner().unwrap()))
    }

    fn keys_and_fields(samples: &[Sample]) -> Vec<(String, Vec<String>)> {
        samples
            .iter()
            .map(|s| {
                (
                    s.key.to_string(),
                    s.fields.iter().map(|(n, _)| n.to_string()).collect(),
                )
            })
            .collect()
    }

    /// Keys are slices of the shard's bytes (no allocation per sample), long ones too (GNU
    /// long-name records); a non-UTF-8 name gets an owned, lossy key, as before.
    #[test]
    fn keys_borrow_the_shard_bytes() {
        let long = format!("{}/k", "d".repeat(150));
        let data = tar_of(&[
            ("a1.jpg", b"x"),
            ("a1.CLS", b"7"),
            (&format!("{long}.txt"), b"t"),
        ]);
        let url: Arc<str> = Arc::from("u");
        let samples = parse(&data, &url).unwrap();
        let inside = |k: &Key| {
            let at = k.bytes().as_ptr() as usize;
            at >= data.as_ptr() as usize
                && at + k.bytes().len() <= data.as_ptr() as usize + data.len()
        };
        assert_eq!(
            keys_and_fields(&samples),
            [
                ("a1".to_string(), vec!["jpg".to_string(), "cls".to_string()]),
                (long.clone(), vec!["txt".to_string()])
            ]
        );
        assert!(samples.iter().all(|s| inside(&s.key)));
        use std::os::unix::ffi::OsStrExt;
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_size(1);
        h.set_entry_type(tar::EntryType::Regular);
        let name = std::ffi::OsStr::from_bytes(b"b\xff.jpg");
        b.append_data(&mut h, name, &b"x"[..]).unwrap();
        let raw = b.into_inner().unwrap();
        let odd = parse(&ShardBytes::heap(Bytes::from(raw)), &url).unwrap();
        assert_eq!(odd[0].key, "b\u{fffd}");
        assert!(!inside(&odd[0].key));
    }

    #[test]
    fn split_name_matches_webdataset_regex() {
        // Expected values computed with webdataset.tariterators.base_plus_ext.
        let cases: &[(&str, Option<(&str, &str)>)] = &[
            ("a.jpg", Some(("a", "jpg"))),
            ("dir/a.seg.png", Some(("dir/a", "seg.png"))),
            ("d.x/y/a.b.c", Some(("d.x/y/a", "b.c"))),
            ("a.b/c.d.e", Some(("a.b/c", "d.e"))),
            ("dir/.hidden", Some(("dir/", "hidden"))),
            ("x/dir/.h.j", Some(("x/dir/", "h.j"))),
            ("x.y/.h", None),
            (".hidden", None),
            ("noext", None),
            ("a.b/noext", None),
            ("a.", Some(("a", ""))),
            ("a//.x", Some(("a//", "x"))),
            ("x/y.z/w/.q", Some(("x/y.z/w/", "q"))),
            // Newlines: `.` does not match one (issue 8, found by the tar fuzz target).
            ("30 path=a/very/long/name.jpg\n0/k.jpg", None),
            ("a\nb/c.d", Some(("a\nb/c", "d"))),
            ("a/b\nc/d.e", Some(("a/b\nc/d", "e"))),
            ("x.y\n/z.w", None),
            ("a/b.c\n", Some(("a/b", "c\n"))),
            ("d\n/.e", Some(("d\n/", "e"))),
            ("a/\n/.e", Some(("a/\n/", "e"))),
            ("a.b/c\nd.e", Some(("a.b/c\nd", "e"))),
            ("a\n.b", Some(("a\n", "b"))),
            ("\n/x.y", Some(("\n/x", "y"))),
            ("a/b/c\nd/e.f", Some(("a/b/c\nd/e", "f"))),
        ];
        for (name, want) in cases {
            assert_eq!(split_name(name), *want, "{name}");
        }
    }

    #[test]
    fn meta_names_match_webdataset() {
        // Expected values computed with webdataset's tar_file_iterator rules.
        for (name, meta) in [
            ("__x.y__\n", true),
            ("__x__\n", true),
            ("__a.b__", true),
            ("__\n__/x.jpg", true),
            ("__x.y__\nz", false),
            ("__a__\n/b.c", false),
            ("___.x", false),
            ("__", true),
            ("__index__/x.json", true),
        ] {
            assert_eq!(is_meta(name), meta, "{name:?}");
        }
    }

    #[test]
    fn groups_consecutive_members() {
        let data = tar_of(&[
            ("d.v1/s0.jpg", b"J0"),
            ("d.v1/s0.CLS", b"0"),
            ("d.v1/s0.seg.png", b"P0"),
            ("d.v1/s1.jpg", b"J1"),
            ("__meta__", b"m"),
            ("__index__/x.json", b"i"),
            ("README", b"skipped: no dot"),
            ("d.v1/s2.cls", b"2"),
        ]);
        let url: Arc<str> = Arc::from("gs://b/s.tar");
        let samples = parse(&data, &url).unwrap();
        assert_eq!(
            keys_and_fields(&samples),
            vec![
                (
                    "d.v1/s0".into(),
                    vec!["jpg".into(), "cls".into(), "seg.png".into()]
                ),
                ("d.v1/s1".into(), vec!["jpg".into()]),
                ("d.v1/s2".into(), vec!["cls".into()]),
            ]
        );
        assert_eq!(&samples[0].fields[2].1[..], b"P0");
        assert_eq!(&*samples[2].url, "gs://b/s.tar");
    }

    #[test]
    fn long_names_gnu_and_pax() {
        let long_dir = "x".repeat(150);
        let gnu_name = format!("{long_dir}/sample.json");
        let gnu = tar_of(&[(gnu_name.as_str(), b"{}")]);
        let s = parse(&gnu, &Arc::from("u")).unwrap();
        assert_eq!(s[0].key, format!("{long_dir}/sample"));

        let mut b = tar::Builder::new(Vec::new());
        let pax_name = format!("{}/y.txt", "p".repeat(200));
        b.append_pax_extensions([("path", pax_name.as_bytes())])
            .unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_size(3);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_path("short.txt").unwrap();
        h.set_cksum();
        b.append(&h, &b"abc"[..]).unwrap();
        let pax = ShardBytes::heap(Bytes::from(b.into_inner().unwrap()));
        let s = parse(&pax, &Arc::from("u")).unwrap();
        assert_eq!(s[0].key, format!("{}/y", "p".repeat(200)));
        assert_eq!(&s[0].fields[0].1[..], b"abc");
    }

    /// Issue 8: a header whose checksum is the signed-char sum (old Sun/NeXT tars) was
    /// refused, though Python's `tarfile` (`calc_chksums`) and so webdataset read it.
    #[test]
    fn signed_checksum_headers_are_read() {
        let name = "données/été.jpg"; // bytes of 0x80 and up: the two sums differ
        let mut h = tar::Header::new_ustar();
        h.set_path(name).unwrap();
        h.set_size(5);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.set_cksum();
        let block = h.as_bytes().to_vec();
        let rest = || block[..148].iter().chain(&block[156..]);
        let unsigned: i64 = 256 + rest().map(|b| *b as i64).sum::<i64>();
        let signed: i64 = 256 + rest().map(|b| *b as i8 as i64).sum::<i64>();
        assert!(signed > 0 && signed != unsigned);
        let with_cksum = |sum: i64| {
            let mut b = block.clone();
            b[148..156].copy_from_slice(format!("{sum:06o}\0 ").as_bytes());
            b.extend_from_slice(b"hello");
            b.resize(512 + 512 + 1024, 0);
            ShardBytes::heap(Bytes::from(b))
        };
        let url: Arc<str> = Arc::from("gs://b/sun.tar");
        for sum in [unsigned, signed] {
            let s = parse(&with_cksum(sum), &url).unwrap();
            assert_eq!(s.len(), 1);
            assert_eq!(s[0].key, "données/été");
            assert_eq!(&*s[0].fields[0].0, "jpg");
            assert_eq!(&s[0].fields[0].1[..], b"hello");
        }
        // Any other value is still a bad header.
        let err = parse(&with_cksum(signed + 1), &url)
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "gs://b/sun.tar: not a valid tar file: archive header checksum mismatch"
        );
    }

    /// Issue 8 (fuzzing, `tar` target against its reference walk): a PAX `size` record
    /// followed by a GNU long-name header was applied to the long-name header, so the shard
    /// silently yielded no samples, where tarfile (webdataset) reads the file with the PAX size.
    #[test]
    fn pax_size_describes_the_member_after_a_long_name() {
        let raw = |name: &str, size: u64, kind: tar::EntryType| {
            let mut h = tar::Header::new_gnu();
            h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
            h.set_size(size);
            h.set_mode(0o644);
            h.set_entry_type(kind);
            h.set_cksum();
            h.as_bytes().to_vec()
        };
        let padded = |b: &[u8]| {
            let mut b = b.to_vec();
            b.resize(b.len().next_multiple_of(512), 0);
            b
        };
        let long = format!("dir/{}.jpg", "n".repeat(120));
        let mut data = raw("pax", 10, tar::EntryType::XHeader);
        data.extend(padded(b"10 size=5\n"));
        data.extend(raw(
            "././@LongLink",
            long.len() as u64 + 1,
            tar::EntryType::GNULongName,
        ));
        data.extend(padded(format!("{long}\0").as_bytes()));
        data.extend(raw("short.jpg", 999, tar::EntryType::Regular)); // PAX says 5
        data.extend(padded(b"hello"));
        data.extend([0u8; 1024]);
        let s = parse(&ShardBytes::heap(Bytes::from(data)), &Arc::from("u")).unwrap();
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].key, format!("dir/{}", "n".repeat(120)));
        assert_eq!(&s[0].fields[0].1[..], b"hello");
    }

    /// Issue 8 (fuzzing, `tar` target against its reference walk): a PAX path holding a
    /// newline was refused ("malformed pax extension": the `tar` crate splits records at
    /// newlines), though PAX records are length-prefixed for this and tarfile reads them.
    #[test]
    fn pax_records_are_read_by_length() {
        let pax = |records: &[u8]| {
            let mut b = tar::Builder::new(Vec::new());
            let mut h = tar::Header::new_ustar();
            h.set_size(records.len() as u64);
            h.set_entry_type(tar::EntryType::XHeader);
            h.set_cksum();
            b.append(&h, records).unwrap();
            let mut h = tar::Header::new_ustar();
            h.set_size(3);
            h.set_path("short.txt").unwrap();
            h.set_cksum();
            b.append(&h, &b"abc"[..]).unwrap();
            parse(
                &ShardBytes::heap(Bytes::from(b.into_inner().unwrap())),
                &Arc::from("u"),
            )
        };
        // A record's length counts the whole record, its own digits included.
        let s = pax(b"16 path=a\nb/c.d\n").unwrap();
        assert_eq!(s[0].key, "a\nb/c");
        assert_eq!(&s[0].fields[0].1[..], b"abc");
        // Padding after the records ends them, as in tarfile.
        let s = pax(b"16 path=x/y.bin\n\0\0\0\0").unwrap();
        assert_eq!((s[0].key.as_str(), &*s[0].fields[0].0), ("x/y", "bin"));
        for (records, why) in [
            (
                &b"99 path=x/y.bin\n"[..],
                "a PAX record's length does not fit its header",
            ),
            (
                b"0 path=x\n",
                "a PAX record's length does not fit its header",
            ),
            (b"17 path=x/y.bin  ", "malformed PAX record"),
            (b"11 pathxxx\n", "malformed PAX record"),
            (b"11 size=+3\n", "invalid PAX size record"),
        ] {
            let err = pax(records).unwrap_err().to_string();
            assert_eq!(
                err,
                format!("u: not a valid tar file: {why}"),
                "{records:?}"
            );
        }
    }

    #[test]
    fn errors_name_the_shard() {
        let url: Arc<str> = Arc::from("gs://b/bad.tar");
        let dup = tar_of(&[("k.jpg", b"1"), ("k.JPG", b"2")]);
        let err = parse(&dup, &url).unwrap_err().to_string();
        assert!(
            err.contains("gs://b/bad.tar") && err.contains("duplicate field \"jpg\""),
            "{err}"
        );

        let garbage = ShardBytes::heap(Bytes::from(vec![0x5au8; 4096]));
        let err = parse(&garbage, &url).unwrap_err().to_string();
        assert!(
            err.starts_with("gs://b/bad.tar: not a valid tar file"),
            "{err}"
        );

        let err = parse(&ShardBytes::default(), &url).unwrap_err().to_string();
        assert_eq!(err, "gs://b/bad.tar: empty file, not a tar");

        // Sizes near u64::MAX (base-256 or PAX) must not wrap the walk around or panic.
        for size in [u64::MAX, u64::MAX - 511, 1 << 40] {
            let mut h = tar::Header::new_gnu();
            h.set_path("noext").unwrap();
            h.set_size(size);
            h.set_entry_type(tar::EntryType::Regular);
            h.set_cksum();
            let mut data = h.as_bytes().to_vec();
            data.extend_from_slice(&[0u8; 1024]);
            let err = parse(&ShardBytes::heap(Bytes::from(data)), &url)
                .unwrap_err()
                .to_string();
            assert!(err.contains("truncated: member \"noext\""), "{size}: {err}");
        }
        let mut b = tar::Builder::new(Vec::new());
        b.append_pax_extensions([("size", u64::MAX.to_string().as_bytes())])
            .unwrap();
        let mut h = tar::Header::new_ustar();
        h.set_size(3);
        h.set_path("k.txt").unwrap();
        h.set_cksum();
        b.append(&h, &b"abc"[..]).unwrap();
        let err = parse(
            &ShardBytes::heap(Bytes::from(b.into_inner().unwrap())),
            &url,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("truncated: member \"k.txt\""), "{err}");

        let whole = tar_of(&[("k.bin", &[7u8; 5000])]);
        let cut = whole.slice(..2048);
        let err = parse(&cut, &url).unwrap_err().to_string();
        assert!(err.contains("truncated"), "{err}");
    }
}
