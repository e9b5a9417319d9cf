//! A manifest indexed in parts, one per host of a pod, then merged: `shardd index --part i/N`
//! reads only the shards whose position in the patterns is `i` modulo `N` (strided, so each
//! part holds shards from the whole list and parts are alike in size), and `--merge` checks
//! that the parts cover the patterns exactly once (no shard twice, none missing, none other)
//! before it writes one manifest, the one a single host would have written: entries in the
//! patterns' order, totals summed again.

use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

use super::{Entry, Manifest};
use crate::config::url::ShardUrl;

/// Part `index` of `count` (`i/N` on the command line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub index: u32,
    pub count: u32,
}

impl FromStr for Part {
    type Err = String;

    fn from_str(s: &str) -> Result<Part, String> {
        let bad = || format!("--part {s:?}: give it as i/N, the part i (from 0) of N, i < N");
        let (i, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count) = (
            i.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if count == 0 || index >= count {
            return Err(bad());
        }
        Ok(Part { index, count })
    }
}

impl fmt::Display for Part {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl Part {
    /// The shards of this part: every `count`-th, from the `index`-th.
    pub fn shards(self, shards: &[ShardUrl]) -> Vec<ShardUrl> {
        shards
            .iter()
            .skip(self.index as usize)
            .step_by(self.count as usize)
            .cloned()
            .collect()
    }
}

/// Why parts do not make the patterns' manifest.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MergeError {
    #[error("{shard} is in two parts, {first} and {second}")]
    Twice {
        shard: String,
        first: String,
        second: String,
    },
    #[error(
        "part {part} lists {shard}, which the patterns do not name (a part of other patterns?)"
    )]
    Other { part: String, shard: String },
    #[error(
        "{missing} of the {total} shards are in no part, the first {first} (number {position} of the patterns: part i/N holds those whose number is i modulo N): run the missing parts, then merge again"
    )]
    Missing {
        missing: usize,
        total: usize,
        first: String,
        position: usize,
    },
}

/// The manifest of `shards` made of `parts` (each: where it was read, and its manifest),
/// whose entries must name every shard once and no other.
pub fn merge(shards: &[ShardUrl], parts: &[(String, Manifest)]) -> Result<Manifest, MergeError> {
    let mut found: HashMap<&str, (&str, &Entry)> = HashMap::new();
    let named: HashMap<&str, usize> = shards
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();
    for (part, manifest) in parts {
        for entry in &manifest.shards {
            if !named.contains_key(entry.url.as_str()) {
                return Err(MergeError::Other {
                    part: part.clone(),
                    shard: entry.url.clone(),
                });
            }
            if let Some((first, _)) = found.insert(&entry.url, (part, entry)) {
                return Err(MergeError::Twice {
                    shard: entry.url.clone(),
                    first: first.to_string(),
                    second: part.clone(),
                });
            }
        }
    }
    let missing: Vec<usize> = (0..shards.len())
        .filter(|&i| !found.contains_key(shards[i].as_str()))
        .collect();
    if let Some(&first) = missing.first() {
        return Err(MergeError::Missing {
            missing: missing.len(),
            total: shards.len(),
            first: shards[first].to_string(),
            position: first,
        });
    }
    Ok(Manifest::new(
        shards.iter().map(|s| found[s.as_str()].1.clone()).collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::Version;
    use std::path::Path;

    fn urls(n: usize) -> Vec<ShardUrl> {
        (0..n)
            .map(|i| ShardUrl::parse(&format!("gs://b/s-{i:02}.tar"), Path::new("/")).unwrap())
            .collect()
    }

    fn entry(url: &ShardUrl) -> Entry {
        Entry {
            url: url.to_string(),
            version: Version {
                size: 100 + url.as_str().len() as u64,
                e_tag: Some(format!("\"{url}\"")),
                generation: None,
            },
            crc32c: 7,
            samples: 3,
        }
    }

    fn parts_of(shards: &[ShardUrl], n: u32) -> Vec<(String, Manifest)> {
        (0..n)
            .map(|i| {
                let part = Part { index: i, count: n };
                let entries = part.shards(shards).iter().map(entry).collect();
                (format!("part {part}"), Manifest::new(entries))
            })
            .collect()
    }

    #[test]
    fn parts_cover_the_shards_once_and_merge_into_the_whole() {
        let shards = urls(11);
        let whole = Manifest::new(shards.iter().map(entry).collect());
        for n in [1, 2, 3, 4, 11, 12] {
            let parts = parts_of(&shards, n);
            let sizes: Vec<usize> = parts.iter().map(|(_, m)| m.shards.len()).collect();
            assert!(
                sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 1,
                "{sizes:?}"
            );
            assert_eq!(merge(&shards, &parts), Ok(whole.clone()), "{n} parts");
        }
    }

    #[test]
    fn a_shard_twice_missing_or_foreign_is_refused_naming_it() {
        let shards = urls(6);
        let mut parts = parts_of(&shards, 3);
        let lost = parts.remove(1);
        assert_eq!(
            merge(&shards, &parts).unwrap_err().to_string(),
            "2 of the 6 shards are in no part, the first gs://b/s-01.tar (number 1 of the patterns: part i/N holds those whose number is i modulo N): run the missing parts, then merge again"
        );
        parts.push(parts[0].clone());
        parts[2].0 = "again".into();
        assert_eq!(
            merge(&shards, &parts).unwrap_err(),
            MergeError::Twice {
                shard: "gs://b/s-00.tar".into(),
                first: "part 0/3".into(),
                second: "again".into()
            }
        );
        let mut other = lost;
        other.1.shards.push(entry(&urls(7)[6]));
        assert!(matches!(
            merge(&shards, &[other]),
            Err(MergeError::Other { .. })
        ));
    }

    #[test]
    fn a_part_is_i_of_n() {
        assert_eq!("2/8".parse(), Ok(Part { index: 2, count: 8 }));
        for bad in ["8/8", "1/0", "x/2", "3", "-1/2"] {
            assert!(bad.parse::<Part>().unwrap_err().contains("i/N"), "{bad}");
        }
    }
}
