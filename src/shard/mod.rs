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
mod tests;
