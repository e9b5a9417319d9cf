//! Tar → samples (`shard::parse`), plain, gzip and zstd, against a simple reference walk written
//! here from the rules (tarfile's, as webdataset reads shards through it):
//! - 512-byte headers; the checksum is the unsigned or the signed sum of the header bytes;
//!   an all-zero block or the end of the data ends the archive; data is padded to 512;
//! - GNU long names (`L`) and PAX records (`x`: `path`, `size`; records parsed by their
//!   length prefix, as tarfile does, so values may hold newlines) describe the next member
//!   that is not itself such an extension header; `K` and `g` are skipped;
//! - members of type `0`, NUL or `7` are files; `S` (sparse) is refused; others are skipped;
//! - key and field come from webdataset's own regex, `^((?:.*/|)[^.]+)[.]([^/]*)$`, and its
//!   metadata rules skip the same names.
//!
//! Property: both agree on every sample and on the exact byte range of every field in the
//! shard (member boundaries), or fail the same way (invalid / truncated / sparse / duplicate
//! field).
//!
//! Input: a mode byte, then the shard. Mode bit 0: repair each header's checksum the
//! reference walk visits (so the fuzzer gets past checksums; bit 1 picks the signed sum);
//! bytes starting with the gzip or a zstd magic are decompressed first (at most 16 MiB) by
//! the cache's own decoders (`shardd::cache::decompress`), as the cache does.
#![cfg_attr(not(test), no_main)]

use std::io::Read;
use std::sync::{Arc, LazyLock};

#[cfg(test)] // tests/fuzz_seeds.rs checks what each seed reached
use crate::reached;
use bytes::Bytes;
#[cfg(not(test))] // tests/fuzz_seeds.rs has its own
use libfuzzer_sys::fuzz_target;
use regex::Regex;
use shardd::cache::ShardBytes;
use shardd::cache::decompress::Compression;
use shardd::shard::{self, MAX_FIELDS, ShardError};

/// What a seed reached: recorded by tests/fuzz_seeds.rs, nothing in the fuzz build.
#[cfg(not(test))]
fn reached(_: impl AsRef<str>) {}

#[derive(Debug, PartialEq, Clone, Copy)]
enum Failure {
    Empty,
    Invalid,
    Truncated,
    Sparse,
    Duplicate,
    TooManyFields,
}

#[derive(Debug, PartialEq)]
struct RefSample {
    key: String,
    fields: Vec<(String, std::ops::Range<usize>)>,
}

#[derive(Clone, Copy)]
enum Repair {
    No,
    Unsigned,
    Signed,
}

fn sums(block: &[u8]) -> (i64, i64) {
    let rest = block[..148].iter().chain(&block[156..]);
    let (mut u, mut s) = (256i64, 256i64);
    for b in rest {
        u += *b as i64;
        s += *b as i8 as i64;
    }
    (u, s)
}

/// A PAX record: key and value.
type PaxRecord<'a> = (&'a [u8], &'a [u8]);

/// tarfile's `_proc_pax` record loop: `"%d %s=%s\n"`, the length counting the whole record;
/// it ends where the bytes stop looking like a record (`\d+ `), e.g. at padding. Where
/// tarfile would guess (a record past the data, no `=` or newline), shardd refuses.
fn pax_records(body: &[u8]) -> Result<Vec<PaxRecord<'_>>, Failure> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < body.len() {
        let rest = &body[pos..];
        let space = rest
            .iter()
            .position(|b| !b.is_ascii_digit())
            .unwrap_or(rest.len());
        if space == 0 || rest.get(space) != Some(&b' ') {
            break;
        }
        let len: usize = std::str::from_utf8(&rest[..space])
            .ok()
            .and_then(|t| t.parse().ok())
            .ok_or(Failure::Invalid)?;
        if len <= space + 1 || len > rest.len() || rest[len - 1] != b'\n' {
            return Err(Failure::Invalid);
        }
        let record = &rest[space + 1..len - 1];
        let eq = record
            .iter()
            .position(|b| *b == b'=')
            .ok_or(Failure::Invalid)?;
        out.push((&record[..eq], &record[eq + 1..]));
        pos += len;
    }
    Ok(out)
}

fn reference(data: &mut [u8], repair: Repair) -> Result<Vec<RefSample>, Failure> {
    if data.is_empty() {
        return Err(Failure::Empty);
    }
    static RE: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"^((?:.*/|)[^.]+)[.]([^/]*)$").unwrap());
    // `re.match(r"__[^/]*__($|/)", fname)`; Python's `$` also matches before a final newline.
    static SKIP_META: LazyLock<Regex> =
        LazyLock::new(|| Regex::new(r"^__[^/]*__(?:\n?\z|/)").unwrap());
    let (re, skip_meta) = (&*RE, &*SKIP_META);
    let len = data.len() as u128;
    let mut pos: u128 = 0;
    let (mut long_name, mut pax_path, mut pax_size): (Option<Vec<u8>>, Option<Vec<u8>>, _) =
        (None, None, None::<u64>);
    let mut samples: Vec<RefSample> = Vec::new();
    loop {
        if pos == len {
            break;
        }
        if len - pos < 512 {
            return Err(Failure::Invalid);
        }
        let at = pos as usize;
        if data[at..at + 512].iter().all(|b| *b == 0) {
            break;
        }
        let (u, s) = sums(&data[at..at + 512]);
        match repair {
            Repair::No => {}
            Repair::Unsigned => {
                data[at + 148..at + 156].copy_from_slice(format!("{u:06o}\0 ").as_bytes())
            }
            Repair::Signed if s >= 0 => {
                data[at + 148..at + 156].copy_from_slice(format!("{s:06o}\0 ").as_bytes())
            }
            Repair::Signed => {}
        }
        let block = &data[at..at + 512];
        let header = tar::Header::from_byte_slice(block);
        let stored = header.cksum().map_err(|_| Failure::Invalid)? as i64;
        if stored != u && stored != s {
            return Err(Failure::Invalid);
        }
        let typ = block[156];
        let extension = matches!(typ, b'L' | b'K' | b'x' | b'g');
        let size = match pax_size.filter(|_| !extension) {
            Some(size) => size,
            None => header.entry_size().map_err(|_| Failure::Invalid)?,
        } as u128;
        let start = pos + 512;
        if start + size > len {
            return Err(Failure::Truncated);
        }
        pos = (start + size.div_ceil(512) * 512).min(len);
        let body = &data[start as usize..(start + size) as usize];
        match typ {
            b'L' => {
                let end = body.iter().position(|b| *b == 0).unwrap_or(body.len());
                long_name = Some(body[..end].to_vec());
            }
            b'x' => {
                for (key, value) in pax_records(body)? {
                    match key {
                        b"path" => pax_path = Some(value.to_vec()),
                        b"size" => {
                            let size = std::str::from_utf8(value)
                                .ok()
                                .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
                                .and_then(|t| t.parse().ok())
                                .ok_or(Failure::Invalid)?;
                            pax_size = Some(size);
                        }
                        _ => {}
                    }
                }
            }
            b'K' | b'g' => {}
            _ => {
                let name = match (pax_path.take(), long_name.take()) {
                    (Some(p), _) | (None, Some(p)) => p,
                    (None, None) => header.path_bytes().into_owned(),
                };
                pax_size = None;
                if typ == b'S' {
                    return Err(Failure::Sparse);
                }
                if !matches!(typ, b'0' | b'\0' | b'7') {
                    continue;
                }
                let name = String::from_utf8_lossy(&name).into_owned();
                // webdataset's tar_file_iterator, both rules as written there.
                let meta = (!name.contains('/') && name.starts_with("__") && name.ends_with("__"))
                    || skip_meta.is_match(&name);
                if meta {
                    continue;
                }
                let Some(caps) = re.captures(&name) else {
                    continue;
                };
                let (key, field) = (caps[1].to_string(), caps[2].to_lowercase());
                let range = start as usize..(start + size) as usize;
                match samples.last_mut() {
                    Some(s) if s.key == key => {
                        if s.fields.len() == MAX_FIELDS {
                            return Err(Failure::TooManyFields);
                        }
                        if s.fields.iter().any(|(f, _)| *f == field) {
                            return Err(Failure::Duplicate);
                        }
                        s.fields.push((field, range));
                    }
                    _ => samples.push(RefSample {
                        key,
                        fields: vec![(field, range)],
                    }),
                }
            }
        }
    }
    Ok(samples)
}

/// Whether the tar parsed (the reference and the parser agreeing either way).
fn check(mut data: Vec<u8>, repair: Repair) -> bool {
    let _ = reference(&mut data, repair); // repairs checksums in place (if asked)
    let want = reference(&mut data, Repair::No);
    let bytes = Bytes::from(data);
    let base = bytes.as_ptr() as usize;
    let url: Arc<str> = Arc::from("fuzz.tar");
    let got = shard::parse(&ShardBytes::heap(bytes.clone()), &url);
    let got = got
        .map(|samples| {
            samples
                .iter()
                .map(|s| RefSample {
                    key: s.key.to_string(),
                    fields: s
                        .fields
                        .iter()
                        .map(|(n, d)| {
                            let at = d.as_ptr() as usize - base;
                            (n.to_string(), at..at + d.len())
                        })
                        .collect(),
                })
                .collect::<Vec<_>>()
        })
        .map_err(|e| match e {
            ShardError::Empty { .. } => Failure::Empty,
            ShardError::Tar { .. } => Failure::Invalid,
            ShardError::Truncated { .. } => Failure::Truncated,
            ShardError::Sparse { .. } => Failure::Sparse,
            ShardError::DuplicateField { .. } => Failure::Duplicate,
            ShardError::TooManyFields { .. } => Failure::TooManyFields,
        });
    assert_eq!(got, want);
    got.is_ok()
}

fuzz_target!(|input: &[u8]| {
    let Some((&mode, data)) = input.split_first() else {
        return reached("empty");
    };
    let repair = match mode & 3 {
        1 => Repair::Unsigned,
        3 => Repair::Signed,
        _ => Repair::No,
    };
    let data = if let Some(compression) = Compression::detect(data) {
        let mut plain = Vec::new();
        let Ok(decoder) = compression.decoder(data) else {
            return reached("not decompressible");
        };
        if decoder.take(16 << 20).read_to_end(&mut plain).is_err() {
            return reached("not decompressible");
        }
        plain
    } else {
        data.to_vec()
    };
    reached(if check(data, repair) {
        "parsed"
    } else {
        "refused"
    });
});
